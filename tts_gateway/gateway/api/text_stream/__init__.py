"""The text-stream WebSocket's protocol side (ElevenLabs' text-to-speech WebSocket API).

``messages`` parses what a client sends, ``session`` runs one socket's contexts, ``service`` accepts
sockets and ``wiring`` builds it from the gateway's services. The text-to-phrase and synthesis parts it
drives live in ``speech/text_stream`` so that Wyoming shares them; this package may import ``speech``,
``triton`` and the root leaves.
"""
