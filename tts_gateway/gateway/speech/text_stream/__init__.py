"""Text that arrives in pieces turned into speech, shared by the text-stream WebSocket and Wyoming.

``phrase_chunker`` decides when buffered text is a phrase worth synthesising, ``synthesis`` turns
phrases into audio, ``text_streaming_model`` hands the text as it comes to a model that takes a text
stream, ``alignment`` estimates which characters each audio message speaks and ``output_format``
converts the audio to the format the client asked for. It may import the rest of ``speech``,
``triton`` and the root leaves.
"""
