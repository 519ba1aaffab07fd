"""Speech: from a request's text and voice to encoded audio.

Owns the speech plan (which model, voice and inputs a request becomes), the service that runs it
sentence by sentence, the voice registry and reference audio, text normalisation and splitting, time
stretch, audio encoding, admission (how many calls run at once) and idle memory release, and in
``text_stream/`` the phrase chunking and synthesis of text that arrives in pieces. It knows nothing of
HTTP or WebSockets: it may import ``triton`` and the root leaves, never ``api`` or ``embedded``.
"""
