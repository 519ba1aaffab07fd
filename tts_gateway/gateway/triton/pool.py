"""Several Triton servers behind one gateway: which exist, which are ready, which takes the next call.

The configured targets are ``host:port`` entries. A name may resolve to several addresses (a
Kubernetes headless Service lists one per ready pod); each address is a server with a gRPC
client of its own, and names are resolved again every ``resolve_interval`` seconds so that
servers that come and go are picked up. A server that leaves is retired: new calls avoid it at
once and its client is closed when its last call has ended.

Calls go to the ready server serving the model with the fewest calls in flight. gRPC's own
client-side balancing (a ``dns:///`` target with ``round_robin``) was not used: it spreads calls
evenly whatever their length (a 30 s stream counts as much as a 0.2 s call), knows nothing of
Triton's readiness or of which models a server has loaded, and hides which server a call went to,
which the failover and the per-server metrics need.

The pool is also the one place where a call meets a server and fails over. A call that a server
fails (it is down, or the model broke; not a rejected request or a slow model) is sent once more
to another ready server: before its first audio nothing was lost; after it, a stream is restarted
only when its caller asks for it (:class:`Failover`), since the audio already sent cannot be
taken back. A patient call (its response has started) whose server is down waits for one to be
ready, up to ``failover_wait`` after its first failure. A server that is down is taken out of
rotation at once; the listeners given to :meth:`TritonPool.on_change` hear of it (the model
catalog follows the ready set).

Readiness is probed every few seconds. A server in rotation that answers the probe "not ready" or
refuses the connection goes out at once; one that does not answer in time stays in for
:data:`SILENT_PROBES_TOLERATED` probes in a row. A server converting speech on its CPUs can keep
the probe waiting past its timeout, and taking the only server out for that would fail every
text stream on it at its next piece of text; a server that is truly gone fails its calls, which
take it out at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from tts_gateway.gateway.errors import GatewayError, ModelUnavailableError, ServerUnavailableError, SynthesisError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.triton.client import Readiness, TritonClient, TritonModelConfig
from tts_gateway.models import contract

logger = logging.getLogger(__name__)

_RESOLVE_TIMEOUT = 5.0
SILENT_PROBES_TOLERATED: Final = 2
# Failures worth another server: it is down or broke, not the request (a 400) or a slow model (a 504).
_FAILOVER = (ServerUnavailableError, SynthesisError)
# How often a call that waits for a ready server looks again (the watcher refreshes the ready set).
_WAIT_STEP = 0.1
# Attempts of one patient call at most. A server that dies mid-call takes three (a model error while it
# goes down, "unavailable" while it is, then the restarted one); a server whose calls fail as unreachable
# while its probe says ready would otherwise be asked again after every probe, and a stream resumed
# mid-way repeats its audio each time.
_MAX_ATTEMPTS: Final = 4

Audio = NDArray[np.float32]


@dataclass(eq=False)
class TritonServer:
    """One Triton server: its client, whether it is ready, what it serves, the calls in flight."""

    address: str
    entry: str
    client: TritonClient
    ready: bool = False
    configs: tuple[TritonModelConfig, ...] = ()
    outstanding: int = 0
    models: frozenset[str] = field(default=frozenset())
    silent_probes: int = 0
    """Readiness probes in a row that got no answer in time while the server was in rotation."""

    def set_configs(self, configs: Sequence[TritonModelConfig]) -> None:
        self.configs = tuple(configs)
        self.models = frozenset(c.name for c in configs)


@dataclass(frozen=True)
class Failover:
    """What a caller wants of a call that a server fails: to hear of it, and a stream restarted.

    ``notify`` learns of each failover, with the failure and whether it came after the call's first
    audio. A stream that broke after its first audio is restarted on another server; ``skip_sent``:
    the model produces the same samples again (a seeded, deterministic request), so the restarted
    stream skips as many samples as the broken one had passed on and the listener hears no seam;
    otherwise the restarted stream is passed on from its start and the part already heard is heard
    again.
    """

    skip_sent: bool
    notify: Callable[[GatewayError, bool], None]


@dataclass
class _Attempts:
    """One call's failed attempts, and until when a patient call may make more."""

    loop: asyncio.AbstractEventLoop
    failover_wait: float
    tried: list[TritonServer] = field(default_factory=list)
    failure: GatewayError | None = None
    failures: int = 0
    first_failed_at: float | None = None

    @property
    def deadline(self) -> float:
        """When a patient call stops waiting for a ready server: ``failover_wait`` after its first failure."""
        start = self.loop.time() if self.first_failed_at is None else self.first_failed_at
        return start + self.failover_wait

    def open(self) -> bool:
        """Whether a patient call may make another attempt."""
        return self.failures < _MAX_ATTEMPTS - 1 and self.loop.time() < self.deadline

    def failed(self, server: TritonServer, exc: GatewayError) -> None:
        if self.first_failed_at is None:
            self.first_failed_at = self.loop.time()
        self.failures += 1
        if server not in self.tried:
            self.tried.append(server)
        self.failure = exc


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into host and port."""
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def join_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TritonPool:
    def __init__(
        self,
        entries: Sequence[str],
        client_factory: Callable[[str], TritonClient],
        metrics: GatewayMetrics,
        *,
        resolve_interval: float = 10.0,
        failover_wait: float = 0.0,
    ) -> None:
        """``failover_wait``: how long a patient call waits for a ready server when none is (one that
        restarts comes back under the same address)."""
        self.entries = tuple(entries)
        self._failover_wait = failover_wait
        self._listeners: list[Callable[[], None]] = []
        self._client_factory = client_factory
        self._metrics = metrics
        self._resolve_interval = resolve_interval
        self._resolved: dict[str, tuple[str, ...]] = {}
        self._servers: dict[str, TritonServer] = {}
        self._retired: list[TritonServer] = []
        self._next_resolve = 0.0
        # Breaks ties between equally loaded servers in turn rather than always to the first.
        self._turn = itertools.count()

    @property
    def servers(self) -> list[TritonServer]:
        return list(self._servers.values())

    def ready_servers(self) -> list[TritonServer]:
        return [b for b in self._servers.values() if b.ready]

    async def refresh(self) -> bool:
        """Resolve the names when due, check every server once; returns whether the ready set changed."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_resolve:
            self._next_resolve = loop.time() + self._resolve_interval
            await self._resolve()
        before = {b.address: b.models for b in self.ready_servers()}
        await asyncio.gather(*(self._check(b) for b in self._servers.values()))
        await self._close_retired()
        return before != {b.address: b.models for b in self.ready_servers()}

    async def _resolve(self) -> None:
        results = await asyncio.gather(*(_addresses(entry) for entry in self.entries), return_exceptions=True)
        for entry, result in zip(self.entries, results, strict=True):
            if isinstance(result, OSError):  # TimeoutError included
                # Keep what the name last resolved to: a DNS hiccup must not take servers away.
                logger.warning("cannot resolve Triton address %s: %s", entry, result or type(result).__name__)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._resolved[entry] = result
        wanted = {address: entry for entry, addresses in self._resolved.items() for address in addresses}
        for address, server in list(self._servers.items()):
            if address not in wanted:
                logger.info("Triton server %s (%s) left", address, server.entry)
                self._retire(self._servers.pop(address))
        for address, entry in wanted.items():
            if address not in self._servers:
                logger.info("Triton server %s (%s) added", address, entry)
                self._servers[address] = TritonServer(address, entry, self._client_factory(address))

    async def _check(self, server: TritonServer) -> None:
        readiness = await server.client.readiness()
        if readiness is Readiness.SILENT and server.ready and server.silent_probes < SILENT_PROBES_TOLERATED:
            server.silent_probes += 1
            logger.warning(
                "Triton server %s did not answer its readiness probe in time (%d in a row); kept in rotation",
                server.address,
                server.silent_probes,
            )
            return
        if readiness is not Readiness.READY:
            if server.ready:
                logger.warning("Triton server %s is not ready (%s)", server.address, readiness.value)
            self.mark_down(server)
            return
        server.silent_probes = 0
        # Read again while no speech model is known: one that reports ready before loading its
        # models (model control "explicit") is picked up once they load.
        if not server.ready or not any(_is_speech_model(c) for c in server.configs):
            try:
                configs = await server.client.model_configs()
            except GatewayError as exc:
                logger.warning("cannot read the model configs of %s: %s", server.address, exc.message)
                return
            if not server.ready:
                logger.info(
                    "Triton server %s ready: %s", server.address, ", ".join(sorted(c.name for c in configs)) or "none"
                )
            server.set_configs(configs)
            server.ready = True
        self._metrics.triton_up.labels(server.address).set(1)

    def mark_down(self, server: TritonServer) -> None:
        """Take ``server`` out of rotation until a check finds it ready again (its configs are read anew)."""
        server.ready = False
        server.set_configs(())
        self._metrics.triton_up.labels(server.address).set(0)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a failed call takes a server out of rotation."""
        self._listeners.append(listener)

    def _retire(self, server: TritonServer) -> None:
        self.mark_down(server)
        self._retired.append(server)

    async def _close_retired(self) -> None:
        idle = [b for b in self._retired if b.outstanding == 0]
        self._retired = [b for b in self._retired if b.outstanding > 0]
        for server in idle:
            await server.client.close()
            for metric in (self._metrics.triton_up, self._metrics.triton_outstanding):
                with contextlib.suppress(KeyError):
                    metric.remove(server.address)

    def pick(self, model: str, exclude: Sequence[TritonServer] = ()) -> TritonServer | None:
        """The ready server serving ``model`` with the fewest calls in flight, ``None`` if there is none."""
        candidates = [b for b in self._servers.values() if b.ready and model in b.models and b not in exclude]
        if not candidates:
            return None
        turn = next(self._turn) % len(candidates)
        return min(candidates[turn:] + candidates[:turn], key=lambda b: b.outstanding)

    @contextlib.contextmanager
    def call(self, server: TritonServer) -> Iterator[None]:
        """Counts one call at ``server`` while it runs, and its outcome."""
        server.outstanding += 1
        self._metrics.triton_outstanding.labels(server.address).inc()
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            server.outstanding -= 1
            self._metrics.triton_outstanding.labels(server.address).dec()
            self._metrics.triton_calls.labels(server.address, outcome).inc()

    # -- calls -----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session(self, model: str) -> AsyncIterator[TritonClient]:
        """The client of the ready server serving ``model`` with the fewest calls in flight, for a
        session of many calls (a text stream); the session counts as one call there until it ends.

        There is no failover: a session's state (voice, text so far) lives in its server.
        """
        server = await self._choose(model, self._attempts(), patient=False)
        with self.call(server):
            yield server.client

    async def infer(
        self,
        model: str,
        values: Mapping[str, Any],
        request_id: str,
        *,
        patient: bool = False,
        failover: Failover | None = None,
    ) -> Audio:
        """One offline call on the least busy server, sent once more to another if that one fails it.

        ``patient``: the caller's response has started, so trying on, and waiting for a ready server,
        up to ``failover_wait`` beats failing at once.
        """
        attempts = self._attempts()
        while True:
            server = await self._choose(model, attempts, patient=patient)
            try:
                with self.call(server):
                    return await server.client.infer(model, values, request_id)
            except _FAILOVER as exc:
                self._retry(attempts, server, exc, request_id, patient=patient, before_audio=True)
                if failover is not None:
                    failover.notify(exc, False)

    async def stream(
        self,
        model: str,
        values: Mapping[str, Any],
        request_id: str,
        *,
        patient: bool = False,
        failover: Failover | None = None,
    ) -> AsyncGenerator[Audio, None]:
        """A decoupled model's chunks from the least busy server.

        A call that fails before its first chunk is sent once more to another server (a patient one
        is tried on as :meth:`infer` does). One that fails after it is restarted on another server
        (tried on as a patient call is) if ``failover`` is given, and is the caller's failure otherwise.
        """
        attempts = self._attempts()
        sent = 0  # samples passed on so far, over every attempt
        while True:
            server = await self._choose(model, attempts, patient=patient or sent > 0)
            # What a restarted deterministic stream repeats of what was already passed on.
            skip = sent if failover is not None and failover.skip_sent else 0
            received = 0
            try:
                with self.call(server):
                    async with contextlib.aclosing(server.client.stream(model, values, request_id)) as chunks:
                        async for chunk in chunks:
                            received += chunk.size
                            if received <= skip:
                                continue
                            fresh = chunk[max(0, chunk.size - (received - skip)) :]
                            sent += fresh.size
                            yield fresh
                return
            except _FAILOVER as exc:
                if sent > 0 and failover is None:
                    raise
                self._retry(attempts, server, exc, request_id, patient=patient or sent > 0, before_audio=sent == 0)
                if failover is not None:
                    failover.notify(exc, sent > 0)

    def _attempts(self) -> _Attempts:
        return _Attempts(asyncio.get_running_loop(), self._failover_wait)

    async def _choose(self, model: str, attempts: _Attempts, *, patient: bool) -> TritonServer:
        """The server for the next attempt: another one than those tried if there is one.

        A patient call otherwise waits for a server to become ready, up to ``failover_wait`` after
        its first failure (or, before any, after now), and takes a tried one too (a restarted server
        comes back under its address). With none, the last attempt's failure is the caller's, or a
        503 if there was no attempt.
        """
        loop = asyncio.get_running_loop()
        deadline = attempts.deadline if patient else loop.time()
        while True:
            server = self.pick(model, exclude=attempts.tried) or (self.pick(model) if patient else None)
            if server is not None:
                return server
            if loop.time() >= deadline:
                raise attempts.failure or ServerUnavailableError(f"no ready Triton server serves model {model!r}")
            await asyncio.sleep(_WAIT_STEP)

    def _retry(
        self,
        attempts: _Attempts,
        server: TritonServer,
        exc: GatewayError,
        request_id: str,
        *,
        patient: bool,
        before_audio: bool,
    ) -> None:
        """Records a failed attempt, or raises ``exc`` when the call has none left.

        Every call gets one more attempt. A patient one also tries on while its last attempt found the
        server down, until ``failover_wait`` after its first failure and for :data:`_MAX_ATTEMPTS` in
        all: a server that dies may first fail a call as a model error, and only the next attempt finds
        it gone (and waits for its restart). A model that failed twice is not asked again: each
        mid-stream restart repeats audio.
        """
        if attempts.tried and not (patient and _server_down(exc) and attempts.open()):
            raise exc
        self._failed(server, exc, request_id, before_audio=before_audio)
        attempts.failed(server, exc)

    def _failed(self, server: TritonServer, exc: GatewayError, request_id: str, *, before_audio: bool) -> None:
        if _server_down(exc):
            self.mark_down(server)
            for listener in self._listeners:
                listener()
        when = "before any audio" if before_audio else "mid-stream"
        logger.warning(
            "call %s failed at %s %s (%s); trying another server", request_id, server.address, when, exc.message
        )
        if before_audio:
            self._metrics.triton_retries.inc()

    async def close(self) -> None:
        for server in [*self._servers.values(), *self._retired]:
            await server.client.close()
        self._servers.clear()
        self._retired.clear()


def _server_down(exc: GatewayError) -> bool:
    """Whether a call's failure says its server is down. A model that reports itself unavailable
    answered: its Triton is up and keeps its other models."""
    return isinstance(exc, ServerUnavailableError) and not isinstance(exc, ModelUnavailableError)


def _is_speech_model(config: TritonModelConfig) -> bool:
    return contract.PARAM_TTS_CONTRACT in config.parameters


async def _addresses(entry: str) -> tuple[str, ...]:
    """The addresses ``entry`` names: itself for an IP address, every address of a name otherwise.

    IPv4 addresses are preferred when a name has both kinds: ``localhost``, or a dual-stack pod, is one
    server under two addresses, and counting it twice would skew the balance.
    """
    host, port = split_target(entry)
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return (entry,)
    # Bounded: a resolver that does not answer must not hold up the readiness checks behind it.
    async with asyncio.timeout(_RESOLVE_TIMEOUT):
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    families = {info[0] for info in infos}
    family = socket.AF_INET if socket.AF_INET in families else socket.AF_INET6
    return tuple(dict.fromkeys(join_target(str(info[4][0]), port) for info in infos if info[0] == family))
