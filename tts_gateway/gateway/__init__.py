"""OpenAI-compatible speech gateway in front of Triton Inference Server.

The package is layered; a module imports only from its own subpackage or from a layer below it:

- ``api/`` (HTTP routes, OpenAI and ElevenLabs schemas, the text-stream WebSocket, Wyoming) on top,
- ``speech/`` (planning and synthesising speech, voices, text, audio) below it,
- ``triton/`` (calling Triton servers) and ``embedded/`` (running Triton servers in process) at the bottom,
  side by side and independent of each other.

At this root live only the composition root, which wires the layers together (``app_factory``, ``cli``),
and the leaves every layer uses, which import no subpackage: ``settings``, ``errors`` (the gateway's
exception types), ``metrics`` and ``request_ids``. ``tests/unit/test_import_layers.py`` holds the rule.
"""
