"""Presentation: terminal, notebook, figures and CI outputs of a Report (rich and matplotlib live here)."""
