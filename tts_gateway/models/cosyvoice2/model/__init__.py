"""CosyVoice2's networks and their configuration: what a checkpoint holds and how it computes."""
