"""Decoding with instrumentation, model backends, workloads and the trace store."""
