"""OpenAI-compatible speech gateway in front of Triton Inference Server."""
