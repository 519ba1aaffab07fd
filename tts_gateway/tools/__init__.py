"""Operator tools: model download, checkpoints, TensorRT-LLM engines, repository rendering, voices."""
