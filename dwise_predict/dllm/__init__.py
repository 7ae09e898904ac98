"""dllm"""
