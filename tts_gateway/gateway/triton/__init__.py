"""Calling Triton servers over gRPC.

Owns the client of one server, the pool that spreads calls over servers and fails over, the text-stream
call of a model that takes text as it comes, the catalog of speech models the servers serve and the live
catalog that follows their readiness. A "server" here is always a Triton server. It may import only the
root leaves and ``tts_gateway.models`` (the models' input and output contracts), never ``speech``,
``api`` or ``embedded``.
"""
