"""The runtime: the DWISE policy, the SGLang hook, its launcher and plugin (no training stack, no simulator)."""
