"""Several Triton servers behind one gateway: which exist, which are ready, which takes the next call.

The configured targets are ``host:port`` entries. A name may resolve to several addresses (a
Kubernetes headless Service lists one per ready pod); each address is a backend with a gRPC
client of its own, and names are resolved again every ``resolve_interval`` seconds so that
servers that come and go are picked up. A backend that leaves is retired: new calls avoid it at
once and its client is closed when its last call has ended.

Calls go to the ready backend serving the model with the fewest calls in flight. gRPC's own
client-side balancing (a ``dns:///`` target with ``round_robin``) was not used: it spreads calls
evenly whatever their length (a 30 s stream counts as much as a 0.2 s call), knows nothing of
Triton's readiness or of which models a server has loaded, and hides which server a call went to,
which the retry before the first byte and the per-backend metrics need.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from tts_gateway.gateway.errors import GatewayError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.triton_client import TritonClient, TritonModelConfig
from tts_gateway.models import contract

logger = logging.getLogger(__name__)

_RESOLVE_TIMEOUT = 5.0


@dataclass(eq=False)
class TritonBackend:
    """One Triton server: its client, whether it is ready, what it serves, the calls in flight."""

    address: str
    entry: str
    client: TritonClient
    ready: bool = False
    configs: tuple[TritonModelConfig, ...] = ()
    outstanding: int = 0
    models: frozenset[str] = field(default=frozenset())

    def set_configs(self, configs: Sequence[TritonModelConfig]) -> None:
        self.configs = tuple(configs)
        self.models = frozenset(c.name for c in configs)


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
    ) -> None:
        self.entries = tuple(entries)
        self._client_factory = client_factory
        self._metrics = metrics
        self._resolve_interval = resolve_interval
        self._resolved: dict[str, tuple[str, ...]] = {}
        self._backends: dict[str, TritonBackend] = {}
        self._retired: list[TritonBackend] = []
        self._next_resolve = 0.0
        # Breaks ties between equally loaded backends in turn rather than always to the first.
        self._turn = itertools.count()

    @property
    def backends(self) -> list[TritonBackend]:
        return list(self._backends.values())

    def ready_backends(self) -> list[TritonBackend]:
        return [b for b in self._backends.values() if b.ready]

    async def refresh(self) -> bool:
        """Resolve the names when due, check every backend once; returns whether the ready set changed."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_resolve:
            self._next_resolve = loop.time() + self._resolve_interval
            await self._resolve()
        before = {b.address: b.models for b in self.ready_backends()}
        await asyncio.gather(*(self._check(b) for b in self._backends.values()))
        await self._close_retired()
        return before != {b.address: b.models for b in self.ready_backends()}

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
        for address, backend in list(self._backends.items()):
            if address not in wanted:
                logger.info("Triton backend %s (%s) left", address, backend.entry)
                self._retire(self._backends.pop(address))
        for address, entry in wanted.items():
            if address not in self._backends:
                logger.info("Triton backend %s (%s) added", address, entry)
                self._backends[address] = TritonBackend(address, entry, self._client_factory(address))

    async def _check(self, backend: TritonBackend) -> None:
        if not await backend.client.is_ready():
            if backend.ready:
                logger.warning("Triton backend %s is not ready", backend.address)
            self.mark_down(backend)
            return
        # Read again while no speech model is known: one that reports ready before loading its
        # models (model control "explicit") is picked up once they load.
        if not backend.ready or not any(_is_speech_model(c) for c in backend.configs):
            try:
                configs = await backend.client.model_configs()
            except GatewayError as exc:
                logger.warning("cannot read the model configs of %s: %s", backend.address, exc.message)
                return
            if not backend.ready:
                logger.info(
                    "Triton backend %s ready: %s", backend.address, ", ".join(sorted(c.name for c in configs)) or "none"
                )
            backend.set_configs(configs)
            backend.ready = True
        self._metrics.triton_up.labels(backend.address).set(1)

    def mark_down(self, backend: TritonBackend) -> None:
        """Take ``backend`` out of rotation until a check finds it ready again (its configs are read anew)."""
        backend.ready = False
        backend.set_configs(())
        self._metrics.triton_up.labels(backend.address).set(0)

    def _retire(self, backend: TritonBackend) -> None:
        self.mark_down(backend)
        self._retired.append(backend)

    async def _close_retired(self) -> None:
        idle = [b for b in self._retired if b.outstanding == 0]
        self._retired = [b for b in self._retired if b.outstanding > 0]
        for backend in idle:
            await backend.client.close()
            for metric in (self._metrics.triton_up, self._metrics.triton_outstanding):
                with contextlib.suppress(KeyError):
                    metric.remove(backend.address)

    def pick(self, model: str, exclude: Sequence[TritonBackend] = ()) -> TritonBackend | None:
        """The ready backend serving ``model`` with the fewest calls in flight, ``None`` if there is none."""
        candidates = [b for b in self._backends.values() if b.ready and model in b.models and b not in exclude]
        if not candidates:
            return None
        turn = next(self._turn) % len(candidates)
        return min(candidates[turn:] + candidates[:turn], key=lambda b: b.outstanding)

    @contextlib.contextmanager
    def call(self, backend: TritonBackend) -> Iterator[None]:
        """Counts one call at ``backend`` while it runs, and its outcome."""
        backend.outstanding += 1
        self._metrics.triton_outstanding.labels(backend.address).inc()
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            backend.outstanding -= 1
            self._metrics.triton_outstanding.labels(backend.address).dec()
            self._metrics.triton_calls.labels(backend.address, outcome).inc()

    async def close(self) -> None:
        for backend in [*self._backends.values(), *self._retired]:
            await backend.client.close()
        self._backends.clear()
        self._retired.clear()


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
