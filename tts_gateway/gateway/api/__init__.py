"""The gateway's edge: what clients speak to.

Owns the HTTP routes, the OpenAI and ElevenLabs request and response schemas, error responses,
authentication and request limits, the ElevenLabs-compatible text-stream WebSocket (``text_stream/``:
messages, one socket's session, the service that accepts sockets) and the Wyoming server (``wyoming/``).
It turns client requests into calls on ``speech`` and may import ``speech``, ``triton`` and the root
leaves (``settings``, ``errors``, ``metrics``, ``request_ids``); nothing below imports it.
"""
