"""The CosyVoice2 LLM on its own OpenAI-compatible server: the orchestrator's third LLM stage.

Next to the in-Triton LLMs (``tensorrt_llm``, ``llm_torch``), the orchestrator can call a
server that serves the CosyVoice2 HF LLM directory over the OpenAI completions API, streamed:
``trtllm-serve``, vLLM, SGLang or ``transformers serve``. Such a server may run on its own GPU,
with its own engine and batching, and several of them may share the load.

Two request dialects (:class:`LLMServerAPI`), because the servers accept the prompt and the
sampling parameters differently:

- ``vllm`` (vLLM, ``trtllm-serve``, SGLang): the prompt as token ids (``prompt: [int, ...]``);
  ``top_k``, ``min_tokens``, ``repetition_penalty``, ``seed`` and ``stop_token_ids`` are fields
  of the body. trtllm-serve rejects unknown fields, so only fields all three accept are sent.
- ``transformers`` (``transformers serve``): the prompt as text, speech tokens spelt ``<|s_k|>``
  (the tokenizer reads them back as the same ids); sampling as a ``generation_config`` JSON
  string, the one place that server takes ``top_k``, ``min_new_tokens`` and the stop ids.

Streamed chunks carry text (``<|s_k|>`` per speech token) and, from some servers, ``token_ids``;
both become LLM ids as they arrive. The first id that is not a speech token ends the request's
speech (the pipeline stops there). These servers load the LLM as a plain Qwen2, without the
head bias upstream's conversion gives it (-inf outside the speech rows), so a text id can be
drawn; none of the three takes an allow-list of ids in a form all accept, and a ``logit_bias``
lift of the speech rows would change what the repetition penalty does, so none is sent.

Failures before the first token (connection refused or reset, timeout, 429, 5xx) are retried
on another server when there is one; after that, or once tokens have flowed, a failure is a
:class:`~tts_gateway.models.request_parsing.DependencyUnavailableError` (the gateway's 503). A 400 is
the request's own fault (a prompt too long for the server's context, say): a ContractError.
Closing the generator closes the HTTP stream, which is how these servers learn to stop.

Runs in the orchestrator's Python backend, whose requests are threads: a synchronous
``httpx.Client`` per server holds its keep-alive connection pool.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final
from urllib.parse import urlsplit

import httpx

from tts_gateway.models.cosyvoice2.model import vocab
from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest
from tts_gateway.models.request_parsing import ContractError, DependencyUnavailableError

# Statuses that say "not now" rather than "not this request": worth another try before any token.
RETRY_STATUSES: Final = frozenset({408, 429, 500, 502, 503, 504})
# Backoff between attempts: doubling from the base, capped, with jitter so retries spread out.
BACKOFF_BASE_S: Final = 0.25
BACKOFF_MAX_S: Final = 2.0
# An id that is no speech token: what unreadable output text becomes (it ends the speech).
NOT_SPEECH: Final = -1
_SPEECH_TOKEN_TEXT = re.compile(r"<\|s_(\d+)\|>")
_CONTROL_TOKEN_TEXT = re.compile(r"<\|[^<>|\s]{1,64}\|>")


class LLMServerAPI(StrEnum):
    VLLM = "vllm"
    """Token-id prompt, sampling extras as body fields: vLLM, trtllm-serve, SGLang."""
    TRANSFORMERS = "transformers"
    """Text prompt, sampling as a ``generation_config`` JSON string: transformers serve."""


class LLMServerError(RuntimeError):
    """The LLM server answered, but not with speech (a misconfiguration or a bug): an internal error."""


@dataclass(frozen=True)
class LLMServerSettings:
    """Where the LLM servers are and how to talk to them (the orchestrator's ``llm_*`` parameters)."""

    urls: tuple[str, ...]
    """Base URLs as OpenAI clients take them (``http://host:8000/v1``); load goes to the least busy."""
    api: LLMServerAPI
    model: str = ""
    """The ``model`` field of each request; empty leaves it out (a server serving one model)."""
    timeout_s: float = 30.0
    """Longest wait to connect, and for each streamed token, the first included."""
    retries: int = 2
    """Further attempts while no token has arrived yet."""
    max_connections: int = 64
    """Connections kept per server (one per request in flight; idle ones are reused)."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("llm_urls: at least one URL is needed")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"llm_urls: {url!r} is not an http(s) URL")
        if self.timeout_s <= 0:
            raise ValueError("llm_timeout_s must be positive")
        if self.retries < 0:
            raise ValueError("llm_retries must be >= 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], *, max_connections: int) -> LLMServerSettings | None:
        """The settings of an orchestrator config, or None when it names no LLM server (``llm_urls`` empty)."""
        urls = tuple(url for url in re.split(r"[\s,]+", params.get("llm_urls", "")) if url)
        if not urls:
            return None
        return cls(
            urls=urls,
            api=LLMServerAPI(params["llm_api"]),
            model=params.get("llm_served_model", ""),
            timeout_s=float(params["llm_timeout_s"]),
            retries=int(params["llm_retries"]),
            max_connections=max_connections,
        )


def completion_body(
    request: LLMRequest, api: LLMServerAPI, tokenizer: vocab.TextTokenizer | None = None, model: str = ""
) -> dict[str, Any]:
    """The streamed ``/completions`` request body for ``request`` in the server's dialect.

    ``tokenizer`` (the one the server loads) is needed by the ``transformers`` dialect, which
    sends the prompt as text.
    """
    body: dict[str, Any] = {"model": model} if model else {}
    body |= {"stream": True, "max_tokens": request.max_new_tokens, "temperature": request.temperature}
    if request.seed is not None:
        body["seed"] = request.seed
    if api is LLMServerAPI.VLLM:
        body |= {
            "prompt": list(request.input_ids),
            "top_p": request.top_p,
            "min_tokens": request.min_new_tokens,
            "repetition_penalty": request.repetition_penalty,
            "stop_token_ids": list(vocab.STOP_IDS),
            # Speech tokens must come back spelt out even where a tokenizer marks them special.
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        }
        if request.top_k > 0:  # 0 = off in trtllm-serve, -1 in older vLLM: leaving it out is off in both
            body["top_k"] = request.top_k
        return body
    if tokenizer is None:
        raise ValueError("the transformers dialect sends text: pass the tokenizer")
    body["prompt"] = prompt_text(tokenizer, request.input_ids)
    # transformers serve builds its GenerationConfig from this JSON alone (not from the model's).
    generation = {
        "do_sample": request.temperature > 0,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "repetition_penalty": request.repetition_penalty,
        "min_new_tokens": request.min_new_tokens,
        "max_new_tokens": request.max_new_tokens,
        "eos_token_id": list(vocab.STOP_IDS),
        "pad_token_id": vocab.EOS1_ID,
    }
    body["generation_config"] = json.dumps(generation)
    return body


def prompt_text(tokenizer: vocab.TextTokenizer, input_ids: Sequence[int]) -> str:
    """The prompt as text that the server's tokenizer reads back into the same control tokens.

    The pipeline encodes a control token the user typed (``<|eos1|>`` in the input text)
    character by character; as text it would become the real token on the server. Such
    input cannot travel as text and is refused.
    """
    text: str = tokenizer.decode(list(input_ids), skip_special_tokens=False)  # type: ignore[attr-defined]
    control = [token_id for token_id in input_ids if token_id >= vocab.FIRST_TEXT_SPECIAL_ID]
    again = [token_id for token_id in tokenizer.encode(text) if token_id >= vocab.FIRST_TEXT_SPECIAL_ID]
    if again != control:
        raise ContractError("the text spells a control token such as <|...|>, which a text prompt cannot carry")
    return text


class SpeechTokenText:
    """LLM ids from streamed output text, fed in pieces that may split a token's spelling."""

    def __init__(self, added_vocab: Mapping[str, int]) -> None:
        self._added = added_vocab
        self._pending = ""

    def feed(self, text: str) -> list[int]:
        self._pending += text
        ids: list[int] = []
        while self._pending:
            head = self._pending.lstrip()
            if not head:
                self._pending = ""
                break
            match = _CONTROL_TOKEN_TEXT.match(head)
            if match is None:
                if head.startswith("<") and len(head) < 70 and "|>" not in head:
                    self._pending = head  # the rest of this token's spelling is still on its way
                    break
                # Plain text: not speech, and nothing after it is.
                ids.append(NOT_SPEECH)
                self._pending = ""
                break
            ids.append(self._token_id(match.group()))
            self._pending = head[match.end() :]
        return ids

    def _token_id(self, token: str) -> int:
        speech = _SPEECH_TOKEN_TEXT.fullmatch(token)
        if speech is not None and int(speech.group(1)) < vocab.SPEECH_TOKEN_SIZE:
            return vocab.speech_token_to_id(int(speech.group(1)))
        return self._added.get(token, NOT_SPEECH)


@dataclass(eq=False)
class _Server:
    url: str
    client: httpx.Client
    in_flight: int = 0


class LLMServerClient:
    """:meth:`generate` of the pipeline's ``Stages``, over one or several LLM servers."""

    def __init__(self, settings: LLMServerSettings, tokenizer: vocab.TextTokenizer) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._added_vocab = dict(tokenizer.get_added_vocab())
        timeout = httpx.Timeout(settings.timeout_s)
        limits = httpx.Limits(
            max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections
        )
        self._servers = [
            _Server(url, httpx.Client(base_url=url, timeout=timeout, limits=limits)) for url in settings.urls
        ]
        self._lock = threading.Lock()
        self._turn = 0

    def close(self) -> None:
        for server in self._servers:
            server.client.close()

    def generate(self, request: LLMRequest, is_cancelled: Callable[[], bool]) -> Generator[Sequence[int], None, None]:
        """LLM ids in pieces as the server streams them; closing this closes the HTTP stream."""
        body = completion_body(request, self._settings.api, self._tokenizer, self._settings.model)
        attempts = self._settings.retries + 1
        previous: _Server | None = None
        for attempt in range(attempts):
            streamed = False
            try:
                with self._lease(avoid=previous) as server:
                    previous = server
                    for piece in self._stream(server, body):
                        streamed = True
                        yield piece
                return
            except _Retryable as exc:
                if streamed:
                    raise DependencyUnavailableError(f"LLM server {previous.url}: stream broke off: {exc}") from exc
                if attempt + 1 == attempts:
                    raise DependencyUnavailableError(
                        f"no LLM server answered ({attempts} attempts, last {previous.url}): {exc}"
                    ) from exc
                if is_cancelled():
                    return
                time.sleep(_backoff(attempt, exc.retry_after))

    @contextmanager
    def _lease(self, avoid: _Server | None) -> Iterator[_Server]:
        """The server with the fewest requests in flight (taking turns among equals), not ``avoid`` if possible."""
        with self._lock:
            count = len(self._servers)
            ordered = [self._servers[(self._turn + i) % count] for i in range(count)]
            self._turn += 1
            candidates = [server for server in ordered if server is not avoid] or ordered
            server = min(candidates, key=lambda s: s.in_flight)
            server.in_flight += 1
        try:
            yield server
        finally:
            with self._lock:
                server.in_flight -= 1

    def _stream(self, server: _Server, body: dict[str, Any]) -> Iterator[list[int]]:
        text = SpeechTokenText(self._added_vocab)
        try:
            with server.client.stream("POST", "completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise _status_error(server.url, response)
                for data in _sse_data(response.iter_lines()):
                    ids = _chunk_ids(data, text, server.url)
                    if ids:
                        yield ids
        except httpx.TransportError as exc:
            # Connection refused or reset, a timeout, a response cut short.
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _backoff(attempt: int, retry_after: float | None) -> float:
    if retry_after is not None:
        return min(retry_after, BACKOFF_MAX_S)
    return min(BACKOFF_BASE_S * 2**attempt, BACKOFF_MAX_S) * random.uniform(0.5, 1.0)


def _status_error(url: str, response: httpx.Response) -> Exception:
    reason = _error_message(response)
    message = f"LLM server {url} answered {response.status_code}: {reason}"
    if response.status_code in RETRY_STATUSES:
        return _Retryable(message, _retry_after(response))
    if response.status_code == 400:
        # The request's own content (a prompt beyond the server's context, say); no address for the caller.
        return ContractError(f"the LLM server rejected the request: {reason}")
    # 401/404/422 and the like: the orchestrator's settings do not fit the server.
    return LLMServerError(message)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _error_message(response: httpx.Response) -> str:
    """The message of an error body in the shapes these servers use (OpenAI, FastAPI, trtllm-serve)."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            for key in ("message", "detail"):
                if key in error:
                    return str(error[key])[:500]
        return str(error)[:500]
    return str(payload)[:500]


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, up to ``[DONE]``.

    These servers send one JSON object per ``data:`` line and nothing else of SSE
    (no ``event:``, ``id:`` or multi-line data), so the lines are read directly.
    """
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


def _chunk_ids(data: str, text: SpeechTokenText, url: str) -> list[int]:
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise LLMServerError(f"LLM server {url} streamed something other than JSON: {data[:200]!r}") from exc
    if not isinstance(chunk, dict):
        raise LLMServerError(f"LLM server {url} streamed something other than a completion chunk: {data[:200]!r}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        # An error after the stream began: the server failed this request.
        raise DependencyUnavailableError(f"LLM server {url} failed mid-stream: {message}")
    choices = chunk.get("choices") or []
    if not choices:
        return []  # a usage-only chunk
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return [int(token_id) for token_id in token_ids]
    return text.feed(choice.get("text") or "")
