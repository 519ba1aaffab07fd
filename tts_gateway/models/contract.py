"""The request contract every speech model in the Triton repository serves.

The gateway and the Triton models agree on these names and nothing else, so a
new speech model (Piper, CosyVoice2 on PyTorch, CosyVoice2 on TensorRT-LLM) plugs in
without gateway changes. Each speech model is deployed twice from one source
directory: ``NAME`` (offline, one response) and ``NAME_stream`` (decoupled, one
response per audio chunk, then an empty final response; an error ends the stream as
the final response itself).

Inputs (all ``max_batch_size: 0``; only ``target_text`` is required):

==================== ======== ======= =============================================
name                 dtype    dims    meaning
==================== ======== ======= =============================================
target_text          BYTES    [1]     UTF-8 text to speak
reference_wav        FP32     [-1]    reference recording, mono, 16 kHz, [-1, 1]
reference_wav_len    INT32    [1]     valid samples in ``reference_wav``
reference_text       BYTES    [1]     transcript of the reference recording
speed                FP32     [1]     tempo factor, 1.0 = natural
seed                 INT64    [1]     sampling seed (reproducible output)
temperature          FP32     [1]     LLM sampling temperature
top_p                FP32     [1]     LLM nucleus sampling
top_k                INT32    [1]     LLM top-k sampling
voice                BYTES    [1]     one of the model's ``builtin_voices``
instructions         BYTES    [1]     style instruction ("speak slowly and warmly")
==================== ======== ======= =============================================

Output: ``waveform`` FP32 [-1], mono, at the model's declared ``sample_rate``.

Models declare their capabilities as string ``parameters`` in ``config.pbtxt``
(see :data:`CAPABILITY_PARAMETERS`); the gateway reads them from Triton's
model-config API and sends only inputs the model's config lists.

This module must stay importable without ``triton_python_backend_utils`` and
without third-party packages: both sides of the contract import it.
"""

from __future__ import annotations

from typing import Final

TARGET_TEXT: Final = "target_text"
REFERENCE_WAV: Final = "reference_wav"
REFERENCE_WAV_LEN: Final = "reference_wav_len"
REFERENCE_TEXT: Final = "reference_text"
SPEED: Final = "speed"
SEED: Final = "seed"
TEMPERATURE: Final = "temperature"
TOP_P: Final = "top_p"
TOP_K: Final = "top_k"
VOICE: Final = "voice"
INSTRUCTIONS: Final = "instructions"

# A text-streaming session (a model whose ``text_streaming`` parameter is "true", decoupled): the
# request with ``session_id`` and the voice inputs opens it and receives the session's audio (its
# first response is empty: the session is open and takes text); later requests with the same
# ``session_id`` carry ``text_piece`` and/or ``text_end`` (the text is complete) or
# ``session_close`` (end it now) and are answered at once with an empty final response.
# Each request also carries the session id as its Triton correlation id (``sequence_id``), START on
# the opening request and END on the session's last, a close (also sent once a session ended by
# itself: a close of a session not open is done): the model's sequence batcher sends all of a
# session's requests to the instance that holds it.
SESSION_ID: Final = "session_id"
TEXT_PIECE: Final = "text_piece"
TEXT_END: Final = "text_end"
SESSION_CLOSE: Final = "session_close"
# How a model's refusal of an opening request for a session id it holds already reads (the caller
# must not end that sequence: it is the open session's).
SESSION_IN_USE: Final = "is open already"

WAVEFORM: Final = "waveform"

REFERENCE_SAMPLE_RATE: Final = 16_000
STREAM_SUFFIX: Final = "_stream"
# The text-streaming deployment of model NAME is NAME_bistream (text_streaming "true").
TEXT_STREAM_SUFFIX: Final = "_bistream"

# Triton dtype of every contract input, as written in config.pbtxt / the client.
INPUT_DTYPES: Final[dict[str, str]] = {
    TARGET_TEXT: "BYTES",
    REFERENCE_WAV: "FP32",
    REFERENCE_WAV_LEN: "INT32",
    REFERENCE_TEXT: "BYTES",
    SPEED: "FP32",
    SEED: "INT64",
    TEMPERATURE: "FP32",
    TOP_P: "FP32",
    TOP_K: "INT32",
    VOICE: "BYTES",
    INSTRUCTIONS: "BYTES",
    SESSION_ID: "BYTES",
    TEXT_PIECE: "BYTES",
    TEXT_END: "BOOL",
    SESSION_CLOSE: "BOOL",
}

# config.pbtxt ``parameters`` keys by which a model declares what it can do.
PARAM_SAMPLE_RATE: Final = "sample_rate"  # integer, Hz
PARAM_SUPPORTS_CLONING: Final = "supports_cloning"  # "true" / "false"
PARAM_SUPPORTS_SPEED: Final = "supports_speed"  # "true" / "false"
PARAM_BUILTIN_VOICES: Final = "builtin_voices"  # comma-separated ids, may be empty
PARAM_LANGUAGES: Final = "languages"  # comma-separated BCP-47 tags
PARAM_DESCRIPTION: Final = "description"
PARAM_TEXT_STREAMING: Final = "text_streaming"  # "true": sessions whose text arrives in pieces
PARAM_TTS_CONTRACT: Final = "tts_contract"  # "1": marks a model that serves this contract

CAPABILITY_PARAMETERS: Final = (
    PARAM_SAMPLE_RATE,
    PARAM_SUPPORTS_CLONING,
    PARAM_SUPPORTS_SPEED,
    PARAM_BUILTIN_VOICES,
    PARAM_LANGUAGES,
    PARAM_DESCRIPTION,
    PARAM_TTS_CONTRACT,
)
CONTRACT_VERSION: Final = "1"

# A decoupled model's error reaches a gRPC client as its message only; this lead marks the caller's fault.
INVALID_ARG_PREFIX: Final = "[INVALID_ARG]"
# Environment of a Triton server's processes: where that server serves gRPC ("host:port"), for a
# model that calls another model of the same server over gRPC (set by whoever starts the server).
OWN_GRPC_URL_ENV: Final = "TTS_TRITON_GRPC_URL"


def stream_model_name(model: str) -> str:
    """Name of the decoupled twin of offline model ``model``."""
    return model + STREAM_SUFFIX


def parse_bool(value: str) -> bool:
    """Parse a config.pbtxt boolean parameter strictly."""
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_list(value: str) -> tuple[str, ...]:
    """Parse a comma-separated config.pbtxt parameter into its non-empty items."""
    return tuple(item.strip() for item in value.split(",") if item.strip())
