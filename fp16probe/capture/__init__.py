"""Capture: hooks on a model, the statistics engine they feed, and the merge across ranks."""
