"""Prompt features (standard library only: the serving side computes them too)."""
