"""A Wyoming text-to-speech server (Home Assistant's local voice protocol) over the gateway's speech services."""
