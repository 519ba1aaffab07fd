"""Gateway configuration: one settings class, read from ``TTS_*`` variables and ``.env``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tts_gateway.models.model_repository import parse_overrides
from tts_gateway.paths import REFERENCE_VOICES, TRITON_REPOSITORY, invocation_path

# OpenAI's model and voice names, so clients that only know those (Pipecat, LiveKit,
# Home Assistant) work unchanged. Models map to the default model; voices map to
# shipped reference voices (see ``voice_aliases``).
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OPENAI_VOICE_NAMES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
_DEFAULT_VOICE_ALIASES = {name: ("harbor" if index % 2 else "lumen") for index, name in enumerate(OPENAI_VOICE_NAMES)}
_GRPC_URL = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
# A path setting, relative to the directory the gateway was started in (defaults included).
UserPath = Annotated[Path, AfterValidator(invocation_path)]

# Whether the embedded servers run under CUDA MPS (see ``embedded/cuda_mps.py``).
MpsMode = Literal["auto", "on", "off"]
# What CUDA_VISIBLE_DEVICES takes: an index, or a GPU's or MIG instance's UUID.
_GPU_DEVICE: Final = re.compile(r"\d+|(GPU|MIG)-[\w-]+")


def parse_gpu_setting(value: str) -> str:
    """``auto``, ``none`` or comma-separated device names, normalised; raises ``ValueError`` otherwise."""
    value = value.strip()
    if value in ("auto", "none"):
        return value
    devices = [device.strip() for device in value.split(",")]
    if not all(_GPU_DEVICE.fullmatch(device) for device in devices):
        raise ValueError(f"TTS_EMBEDDED_GPUS takes auto, none or GPU ids such as 0,1; got {value!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"TTS_EMBEDDED_GPUS names a GPU twice: {value!r}")
    return ",".join(devices)


class Settings(BaseSettings):
    """Every setting has a ``TTS_`` environment variable (``TTS_TRITON_URL`` ...)."""

    model_config = SettingsConfigDict(env_prefix="TTS_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="gateway processes on one port; they share voices and metrics, admission limits are per process",
    )
    shutdown_grace: int = Field(
        30, ge=0, description="seconds in-flight requests may take to finish after SIGTERM before they are cut"
    )
    ssl_certfile: Path | None = Field(
        None, description="TLS certificate (PEM, chain included): serve https and wss; needs ssl_keyfile"
    )
    ssl_keyfile: Path | None = Field(None, description="the certificate's private key (PEM)")
    keep_alive: int = Field(
        75,
        ge=1,
        description="seconds an idle HTTP connection stays open; longer than clients keep idle connections for"
        " reuse, so that none sends a request on one the gateway is closing",
    )

    triton_url: str | None = Field(
        None,
        description="Triton gRPC addresses host:port, comma-separated; a name may resolve to several servers;"
        " unset starts the embedded server",
    )
    triton_resolve_interval: float = Field(
        10.0, gt=0, description="seconds between DNS lookups of the Triton names (servers that come and go)"
    )
    triton_repository: UserPath = Field(TRITON_REPOSITORY, description="source model repository (templates + profiles)")
    embedded_profile: str = Field("cpu", description="profile rendered for the embedded server")
    embedded_overrides: list[str] = Field(
        default_factory=list, description="MODEL.KEY=VALUE template values replacing the profile's"
    )
    models_root: UserPath | None = Field(
        None,
        description="directory that replaces /models in the embedded profile's model paths (model_dir, llm_dir,"
        " engine_dir), as tts-models --models-root does; unset: the profile's paths as written",
    )
    llm_urls: str | None = Field(
        None,
        description="OpenAI-compatible LLM servers (comma-separated base URLs, http://host:port/v1) for an embedded"
        " profile whose orchestrators use one, such as cosyvoice2-cpu-llm-server; unset: the profile's",
    )
    embedded_workdir: UserPath | None = Field(
        None, description="where the embedded server's repository and logs go (default: a temp dir)"
    )
    embedded_startup_timeout: float = Field(180.0, gt=0)
    # auto: on the H100 MPS took gpu-torch's 64 streams' first audio from 771 to 632 ms p50 and halved their
    # total stall time, for 12-16 ms more at one stream (docs/TUNING.md).
    embedded_cuda_mps: MpsMode = Field(
        "auto",
        description="run the embedded server's model processes under a CUDA MPS daemon of its own, so that"
        " they share the GPU at once (auto: for a profile that asks for it, gpu-torch, where"
        " nvidia-cuda-mps-control is installed)",
    )
    embedded_gpus: str = Field(
        "auto",
        description="GPUs the embedded servers spread over, one Triton per GPU, each supervised and under its own"
        " MPS daemon (auto: every visible GPU for a GPU profile, one server otherwise; none: one server that"
        " sees every GPU; or ids such as 0,1)",
    )

    ref_audios_dir: UserPath = Field(REFERENCE_VOICES, description="shipped voices: NAME.wav + NAME.txt")
    voices_dir: UserPath = Field(Path("data/voices"), description="uploaded voices, persistent")
    default_model: str | None = Field(None, description="model behind tts-1 etc.; unset: best available")
    model_aliases: dict[str, str] = Field(default_factory=dict, description="extra alias -> model id")
    voice_aliases: dict[str, str] = Field(
        default_factory=lambda: dict(_DEFAULT_VOICE_ALIASES),
        description="alias -> reference voice, merged over the defaults for OpenAI's voice names",
    )

    backend_mode: Literal["stream", "offline"] = Field(
        "stream", description="use the decoupled `_stream` models (low latency) or offline ones"
    )
    sentence_max_chars: int = Field(250, ge=20, le=4096)
    first_sentence_max_chars: int = Field(120, ge=10, le=4096)
    sentence_min_chars: int = Field(
        40, ge=0, le=4096, description="shorter sentences are sent together with the next one"
    )
    synthesis_parallelism: int = Field(2, ge=1, le=16, description="sentences in flight per request")
    backend_timeout: float = Field(120.0, gt=0, description="seconds one Triton call may take")
    text_normalization: bool = Field(
        True, description="write numbers, money, dates, units... as words before synthesis (requests may override)"
    )

    ref_min_seconds: float = Field(1.0, gt=0)
    # CosyVoice2's speech tokenizer takes at most 30 s of reference audio.
    ref_max_seconds: float = Field(30.0, gt=0, le=30.0)
    upload_max_bytes: int = Field(10 * 1024 * 1024, gt=0)

    # Network exposure: authentication, request limits, admission control, timeouts.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="accepted bearer keys, comma-separated or a JSON list; empty: no auth"
    )
    public_endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["/health"], description="paths served without a key when keys are set"
    )
    request_max_bytes: int = Field(256 * 1024, gt=0, description="largest request body (voice uploads excepted)")
    max_concurrent_speech: int = Field(8, ge=1, description="speech requests synthesised at once")
    max_queued_speech: int = Field(32, ge=0, description="speech requests waiting for a slot; more get 429")
    queue_timeout: float = Field(30.0, gt=0, description="seconds a speech request may wait for a slot")
    request_timeout: float = Field(300.0, gt=0, description="seconds one speech request may take, queue included")
    backend_chunk_timeout: float = Field(
        30.0, gt=0, description="longest gap between the chunks of a streamed Triton call"
    )
    ws_max_sockets: int = Field(64, ge=1, description="text-streaming WebSockets open at once per worker")
    ws_max_contexts: int = Field(5, ge=1, description="contexts open at once on one text-streaming WebSocket")
    ws_max_buffered_chars: int = Field(
        20_000, ge=100, description="text one WebSocket context may hold that is not yet spoken"
    )
    ws_max_socket_buffered_chars: int = Field(
        40_000, ge=100, description="text one WebSocket's contexts may hold together that is not yet spoken"
    )
    ws_socket_speech_slots: int = Field(
        2,
        ge=1,
        description="of the TTS_MAX_CONCURRENT_SPEECH slots, how many one WebSocket's contexts hold at once",
    )

    # The Wyoming server (Home Assistant's local voice protocol): off unless a port is set.
    wyoming_port: int | None = Field(None, ge=1, le=65535, description="Wyoming text-to-speech port; unset: off")
    wyoming_host: str = Field(
        "127.0.0.1", description="Wyoming bind address; the protocol has no authentication (README, Home Assistant)"
    )
    wyoming_zeroconf: bool = Field(False, description="announce the Wyoming server over zeroconf (_wyoming._tcp)")
    wyoming_max_connections: int = Field(16, ge=1, description="Wyoming connections open at once per worker")
    wyoming_max_buffered_chars: int = Field(
        20_000, ge=100, description="longest synthesize text; unphrased text a streamed Wyoming request may hold"
    )
    wyoming_idle_timeout: float = Field(
        60.0, gt=0, description="seconds a Wyoming connection may stay without an event while nothing is spoken"
    )

    @field_validator("triton_url")
    @classmethod
    def _check_triton_url(cls, value: str | None) -> str | None:
        """Normalised to ``host:port,host:port``."""
        if value is None or not value.strip():
            return None
        entries = [entry.strip().removeprefix("grpc://") for entry in value.replace(" ", ",").split(",")]
        for entry in filter(None, entries):
            if not _GRPC_URL.match(entry):
                raise ValueError(f"TTS_TRITON_URL must list host:port of Triton's gRPC endpoints, got {entry!r}")
        return ",".join(dict.fromkeys(filter(None, entries))) or None

    @property
    def triton_urls(self) -> list[str]:
        """The configured Triton addresses; empty when the embedded server is to start."""
        return self.triton_url.split(",") if self.triton_url else []

    @field_validator("voice_aliases")
    @classmethod
    def _merge_voice_aliases(cls, value: dict[str, str]) -> dict[str, str]:
        return {**_DEFAULT_VOICE_ALIASES, **value}

    @field_validator("api_keys", "public_endpoints", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        """Lists come from the environment as JSON or, more simply, comma-separated."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [item.strip() for item in value.split(",") if item.strip()]

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            secret = key.get_secret_value()
            if not secret or any(c.isspace() for c in secret):
                raise ValueError("API keys must be non-empty and contain no whitespace")
        return value

    @field_validator("public_endpoints")
    @classmethod
    def _check_public_endpoints(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/"):
                raise ValueError(f"public endpoints are paths such as /health, got {path!r}")
        return value

    @field_validator("llm_urls")
    @classmethod
    def _check_llm_urls(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        urls = [url for url in re.split(r"[\s,]+", value) if url]
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"TTS_LLM_URLS must list http(s) base URLs such as http://host:8000/v1, got {url!r}")
        return ",".join(urls)

    @field_validator("embedded_gpus")
    @classmethod
    def _check_embedded_gpus(cls, value: str) -> str:
        return parse_gpu_setting(value)

    @field_validator("embedded_overrides")
    @classmethod
    def _check_overrides(cls, value: list[str]) -> list[str]:
        parse_overrides(value)
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.ref_min_seconds >= self.ref_max_seconds:
            raise ValueError("ref_min_seconds must be below ref_max_seconds")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both ssl_certfile and ssl_keyfile")
        if self.queue_timeout >= self.request_timeout:
            raise ValueError("queue_timeout must be below request_timeout (the wait for a slot is part of a request)")
        return self
