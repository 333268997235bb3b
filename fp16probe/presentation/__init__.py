"""Presentation, one module per medium: terminal (rich), html (Jupyter), figures (matplotlib); answer says what all of them show."""
