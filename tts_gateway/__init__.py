"""tts-gateway: an OpenAI-compatible speech endpoint for CosyVoice2 on Triton."""
