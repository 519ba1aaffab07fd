"""Inference-only CosyVoice2 model code that loads the official checkpoints unchanged."""
