"""Prompt features (standard library and numpy: the serving side computes them too)."""
