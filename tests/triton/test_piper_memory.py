"""A Piper voice leaves nothing allocated once its requests are done, however long their sentences.

Run in a fresh interpreter tuned as the Piper stub is, and read from glibc's own count of the bytes
in use (``mallinfo2``): what the process holds, not what the kernel lends it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")

# Bytes that may stay allocated after the sentences below: Python's own caches, not tensors. They
# run through tensors of tens of MiB; ONNX Runtime's arena kept ~35 MiB of them (the region that
# held the last output), the arena-free session ~0.2 MiB.
LEFT_BEHIND_LIMIT = 8 * 1024 * 1024

# What both probes start with: the stub's heap tuning and glibc's count of the bytes in use.
_IN_USE = textwrap.dedent(
    """
    import ctypes

    from tts_gateway.models.piper import PiperEngine
    from tts_gateway.models.piper.onnx_memory import tune_heap

    assert tune_heap()

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Mallinfo2

    def in_use():
        info = mallinfo2()
        return info.uordblks + info.hblkhd  # in the heap, and in blocks mapped on their own
    """
)

_PROBE = _IN_USE + textwrap.dedent(
    """
    from concurrent.futures import ThreadPoolExecutor

    clause = "a child near the window counted the cows as they passed, one by one, and lost count twice, " * 4
    sentences = [("Then " + clause * repeat).strip(", ") + "." for repeat in (3, 1, 2, 1)]
    engine = PiperEngine()
    with ThreadPoolExecutor(max_workers=2) as pool:  # as the streaming model runs requests
        def synthesize(text):
            return sum(chunk.size for chunk in engine.synthesize(text))

        assert synthesize("Hello.") > 0
        idle = in_use()
        assert sum(pool.map(synthesize, sentences)) > 0
        print(in_use() - idle)
    """
)


def test_long_sentences_leave_no_tensors_allocated() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    assert int(result.stdout.strip()) < LEFT_BEHIND_LIMIT


# Sentences of 40 new lengths: ONNX Runtime's memory patterns kept ~2.2 MiB of plans for them, the
# session without them ~0.2 MiB.
NEW_LENGTHS_LIMIT = 1024 * 1024

_NEW_LENGTHS_PROBE = _IN_USE + textwrap.dedent(
    """
    engine = PiperEngine()
    words = "the train left the station a few minutes late and nobody minded".split()

    def say(count):
        text = " ".join(words[i % len(words)] for i in range(count)) + "."
        return sum(chunk.size for chunk in engine.synthesize(text))

    say(5)
    say(5)
    idle = in_use()
    assert all(say(count) > 0 for count in range(6, 46))
    print(in_use() - idle)
    """
)


def test_sentences_of_ever_new_lengths_leave_nothing_per_length() -> None:
    result = subprocess.run([sys.executable, "-c", _NEW_LENGTHS_PROBE], capture_output=True, text=True, check=True)
    assert int(result.stdout.strip()) < NEW_LENGTHS_LIMIT


# Bytes that phonemizing a sentence leaves allocated in C: espeak-ng kept about 1,360 each time piper
# set its voice, which piper does for every text.
PHONEMIZER_BYTES_PER_SENTENCE_LIMIT = 256

_NATIVE_PROBE = _IN_USE + textwrap.dedent(
    """
    engine = PiperEngine()
    voice = engine._voice
    sentences = [f"Train {number} left at {number % 12} past {number % 60}; nobody minded." for number in range(400)]
    for sentence in sentences[:100]:
        voice.phonemize(sentence)
    before = in_use()
    for sentence in sentences[100:]:
        voice.phonemize(sentence)
    print((in_use() - before) / 300)
    """
)


def test_phonemizing_leaves_no_native_memory_behind() -> None:
    result = subprocess.run([sys.executable, "-c", _NATIVE_PROBE], capture_output=True, text=True, check=True)
    assert float(result.stdout.strip()) < PHONEMIZER_BYTES_PER_SENTENCE_LIMIT


# Python objects that phonemizing leaves behind per request: piper's own espeak bridge kept two per
# clause (14 for the seven clauses below). Counted by where they were allocated, not as a process
# total, because ONNX Runtime keeps allocating a few objects per run for a while after start-up,
# more slowly the slower the machine.
PHONEMIZER_OBJECTS_PER_REQUEST_LIMIT = 0.1

_OBJECTS_PROBE = textwrap.dedent(
    """
    import gc
    import inspect
    import tracemalloc

    from piper.voice import PiperVoice

    from tts_gateway.models.piper import PiperEngine

    engine = PiperEngine()
    text = "Wait, the train is late; nobody minded. Then, at noon: it left! Why?"
    source, first = inspect.getsourcelines(PiperVoice.phonemize)
    phonemize_lines = range(first, first + len(source))
    voice_path = inspect.getsourcefile(PiperVoice)

    def requests(count):
        for _ in range(count):
            assert sum(chunk.size for chunk in engine.synthesize(text)) > 0
        gc.collect()

    def phonemizer_blocks():
        return sum(
            1
            for trace in tracemalloc.take_snapshot().traces
            if any(frame.filename == voice_path and frame.lineno in phonemize_lines for frame in trace.traceback)
        )

    requests(5)
    tracemalloc.start(32)
    requests(5)
    before = phonemizer_blocks()
    requests(100)
    print((phonemizer_blocks() - before) / 100)
    """
)


def test_phonemizing_leaves_no_python_objects_behind() -> None:
    result = subprocess.run([sys.executable, "-c", _OBJECTS_PROBE], capture_output=True, text=True, check=True)
    assert float(result.stdout.strip()) < PHONEMIZER_OBJECTS_PER_REQUEST_LIMIT
