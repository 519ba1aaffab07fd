"""Text streamed in over a WebSocket, speech streamed out (ElevenLabs' text-to-speech WebSocket API).

``phrase_chunker`` decides when buffered text is a phrase worth synthesising, ``synthesis`` turns
phrases (or, for a model that takes text as it comes, the text itself) into audio, ``alignment``
estimates which characters each audio message speaks, ``output_format`` converts the audio to the
format the client asked for, and ``session`` runs one socket's contexts.
"""
