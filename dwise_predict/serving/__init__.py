"""Serving side: bundle loader, DWISE policy, SGLang adapter, simulator (no training stack)."""
