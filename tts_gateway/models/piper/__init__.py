"""Piper neural text-to-speech: the embedded CPU default voice."""

from tts_gateway.models.piper.engine import PiperEngine

__all__ = ["PiperEngine"]
