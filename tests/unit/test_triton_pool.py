"""Which server takes a call, which stay in rotation, how long a call tries on, and what a Triton address names
(no Triton server: the readiness probes meet a port with nothing behind it and a socket that never answers, and
a scripted client dies under its calls; the real servers' failover is in ``tests/e2e/test_stream_failover.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.e2e.gateway_process import free_port
from tests.fixtures.silent_server import silent_server
from tts_gateway.gateway.errors import ServerUnavailableError, SynthesisError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.triton.client import Readiness, TritonClient, TritonModelConfig
from tts_gateway.gateway.triton.pool import (
    _MAX_ATTEMPTS,
    SILENT_PROBES_TOLERATED,
    Failover,
    TritonPool,
    _addresses,
    join_target,
    split_target,
)


def _pool(*addresses: str) -> TritonPool:
    return TritonPool(addresses, lambda address: TritonClient(address, timeout=1), GatewayMetrics())


async def _ready_pool(*addresses: str, models: tuple[str, ...] = ("piper",)) -> TritonPool:
    pool = _pool(*addresses)
    await pool._resolve()
    for server in pool.servers:
        server.set_configs([TritonModelConfig(name, frozenset(), decoupled=False) for name in models])
        server.ready = True
    return pool


async def test_the_least_busy_server_takes_the_call_and_ties_take_turns() -> None:
    pool = await _ready_pool("127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1")
    a, b, c = pool.servers
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert pool.pick("piper") is b
    b.outstanding = 2
    assert pool.pick("piper") is c
    c.outstanding = 2
    assert {pool.pick("piper") for _ in range(6)} == {a, b, c}
    assert pool.pick("piper", exclude=[a, b]) is c
    assert pool.pick("cosyvoice2") is None
    pool.mark_down(c)
    assert pool.pick("piper", exclude=[a, b]) is None
    await pool.close()


async def test_a_call_is_counted_while_it_runs() -> None:
    pool = await _ready_pool("127.0.0.1:1")
    (server,) = pool.servers
    with pool.call(server):
        assert server.outstanding == 1
    with pytest.raises(RuntimeError), pool.call(server):
        raise RuntimeError("failed")
    assert server.outstanding == 0
    await pool.close()


async def test_a_server_that_does_not_answer_its_probe_stays_in_rotation_for_a_while() -> None:
    async with silent_server() as silent:
        pool = await _ready_pool(silent, f"127.0.0.1:{free_port()}")
        busy, gone = pool.servers
        try:
            await pool.refresh()
            # Refused: out at once. No answer in time: still serving, up to the tolerated probes in a row.
            assert not gone.ready and pool.pick("piper") is busy
            for _ in range(SILENT_PROBES_TOLERATED - 1):
                await pool.refresh()
            assert pool.pick("piper") is busy and busy.silent_probes == SILENT_PROBES_TOLERATED
            await pool.refresh()
            assert pool.pick("piper") is None
        finally:
            await pool.close()


async def test_addresses_of_a_name_prefer_ipv4() -> None:
    assert await _addresses("localhost:8001") == ("127.0.0.1:8001",)
    assert await _addresses("10.0.0.7:8001") == ("10.0.0.7:8001",)
    assert await _addresses("[::1]:8001") == ("[::1]:8001",)
    with pytest.raises(OSError):
        await _addresses("no-such-host.invalid:8001")


async def test_a_name_that_does_not_resolve_leaves_the_others_serving() -> None:
    pool = _pool("localhost:8001", "no-such-host.invalid:8001")
    await pool._resolve()
    assert [b.address for b in pool.servers] == ["127.0.0.1:8001"]
    await pool.close()


async def test_every_address_of_a_name_is_a_server_and_one_that_leaves_finishes_its_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A headless Service's name lists one address per ready pod; the list changes as pods come and go."""
    answers = {"triton.tts.svc": ["10.1.0.11", "10.1.0.12"]}

    async def getaddrinfo(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    pool = _pool("triton.tts.svc:8001")
    await pool._resolve()
    assert [(b.address, b.entry) for b in pool.servers] == [
        ("10.1.0.11:8001", "triton.tts.svc:8001"),
        ("10.1.0.12:8001", "triton.tts.svc:8001"),
    ]
    leaving = pool.servers[1]
    leaving.ready = True
    answers["triton.tts.svc"] = ["10.1.0.11", "10.1.0.13"]
    with pool.call(leaving):
        await pool._resolve()
        assert [b.address for b in pool.servers] == ["10.1.0.11:8001", "10.1.0.13:8001"]
        assert not leaving.ready, "no new call goes to a server that left"
        await pool._close_retired()
        assert pool._retired == [leaving], "kept while a call is in flight"
    await pool._close_retired()
    assert pool._retired == []
    await pool.close()


def test_targets_split_and_join() -> None:
    assert split_target("[fd00::1]:8001") == ("fd00::1", 8001)
    assert join_target("fd00::1", 8001) == "[fd00::1]:8001"
    assert split_target("triton-0.triton:8001") == ("triton-0.triton", 8001)


class _FailingServer:
    """A client whose calls fail with ``failures``, one each, then serve. A call failed as unreachable
    (the server went down) leaves its readiness probe "not ready" for ``down_s`` (its restart)."""

    def __init__(self, failures: list[Exception], down_s: float = 0.0) -> None:
        self.calls = 0
        self._failures = failures
        self._down_s = down_s
        self._back_at = 0.0

    async def readiness(self) -> Readiness:
        return Readiness.READY if asyncio.get_running_loop().time() >= self._back_at else Readiness.NOT_READY

    async def model_configs(self) -> list[TritonModelConfig]:
        return [TritonModelConfig("piper_stream", frozenset(), decoupled=True)]

    def _attempt(self) -> None:
        self.calls += 1
        if self._failures:
            failure = self._failures.pop(0)
            if isinstance(failure, ServerUnavailableError):
                self._back_at = asyncio.get_running_loop().time() + self._down_s
            raise failure

    async def stream(self, model: str, values: object, request_id: str) -> AsyncIterator[np.ndarray]:
        self._attempt()
        yield np.ones(4, dtype=np.float32)

    async def infer(self, model: str, values: object, request_id: str) -> np.ndarray:
        self._attempt()
        return np.ones(4, dtype=np.float32)

    async def close(self) -> None:
        pass


def _dying(down_s: float) -> _FailingServer:
    """A server that dies under a call: the call in flight fails as the model's error ("Internal error from
    Core"), the next finds nothing listening, and after ``down_s`` it is back and serves."""
    return _FailingServer([SynthesisError("Internal error from Core"), _gone()], down_s)


def _gone() -> ServerUnavailableError:
    return ServerUnavailableError("Triton server is unavailable")


def _serving(*clients: _FailingServer, failover_wait: float) -> TritonPool:
    by_address = {f"127.0.0.{n}:1": client for n, client in enumerate(clients, start=1)}
    return TritonPool(list(by_address), by_address.__getitem__, GatewayMetrics(), failover_wait=failover_wait)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _watched(pool: TritonPool, every: float = 0.05) -> AsyncIterator[TritonPool]:
    """The readiness probes the gateway runs, at a test's pace."""

    async def watch() -> None:
        while True:
            await pool.refresh()
            await asyncio.sleep(every)

    await pool.refresh()
    watcher = asyncio.create_task(watch())
    try:
        yield pool
    finally:
        watcher.cancel()
        await pool.close()


async def _streamed(pool: TritonPool, *, patient: bool) -> list[np.ndarray]:
    return [chunk async for chunk in pool.stream("piper_stream", {}, "r1", patient=patient)]


async def test_a_patient_call_waits_out_a_restart_that_first_failed_it_as_a_model_error() -> None:
    """The only server dies under a patient call: its first failure leaves the server in rotation, the
    second takes it out, and the call goes on once the server is back, within ``failover_wait``."""
    client = _dying(down_s=0.5)
    notified: list[bool] = []
    async with _watched(_serving(client, failover_wait=5.0)) as pool:
        failover = Failover(skip_sent=False, notify=lambda _exc, mid: notified.append(mid))
        chunks = [c async for c in pool.stream("piper_stream", {}, "r1", patient=True, failover=failover)]
    assert [c.size for c in chunks] == [4]
    assert client.calls == 3 and notified == [False, False]


async def test_a_patient_offline_call_waits_out_a_restart_too() -> None:
    client = _dying(down_s=0.5)
    async with _watched(_serving(client, failover_wait=5.0)) as pool:
        audio = await pool.infer("piper_stream", {}, "r1", patient=True)
    assert audio.size == 4 and client.calls == 3


async def test_a_patient_call_waits_for_a_server_down_no_longer_than_failover_wait() -> None:
    client = _dying(down_s=60)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with _watched(_serving(client, failover_wait=0.5)) as pool:
        with pytest.raises(ServerUnavailableError):
            await _streamed(pool, patient=True)
    assert 0.5 <= loop.time() - started < 2.0
    assert client.calls == 2, "down: the call waited for it to be ready again"


async def test_failover_wait_counts_from_the_first_failure_not_from_each() -> None:
    """A server that keeps coming back and failing again: the wait does not start over at each failure."""
    # Back after 1 s each time: the second attempt comes within the 1.5 s, a third would come after them.
    client = _FailingServer([_gone() for _ in range(10)], down_s=1.0)
    async with _watched(_serving(client, failover_wait=1.5)) as pool:
        with pytest.raises(ServerUnavailableError):
            await _streamed(pool, patient=True)
    assert client.calls == 2


async def test_a_patient_call_makes_a_bounded_number_of_attempts() -> None:
    """Calls that fail as unreachable while the probe says ready are not sent again after every probe."""
    client = _FailingServer([_gone() for _ in range(10)], down_s=0.0)
    async with _watched(_serving(client, failover_wait=5.0)) as pool:
        with pytest.raises(ServerUnavailableError):
            await _streamed(pool, patient=True)
    assert client.calls == _MAX_ATTEMPTS


async def test_a_model_that_fails_twice_is_not_asked_again_even_by_a_patient_call() -> None:
    """Each restart of a stream after its first audio repeats audio: a model that fails it is tried twice."""
    client = _FailingServer([SynthesisError("model broke") for _ in range(3)])
    async with _watched(_serving(client, failover_wait=5.0)) as pool:
        with pytest.raises(SynthesisError, match="model broke"):
            await _streamed(pool, patient=True)
    assert client.calls == 2


async def test_an_impatient_call_is_sent_once_more_only() -> None:
    clients = [_FailingServer([_gone()], down_s=60) for _ in range(3)]
    async with _watched(_serving(*clients, failover_wait=5.0)) as pool:
        with pytest.raises(ServerUnavailableError):
            await _streamed(pool, patient=False)
    assert sorted(client.calls for client in clients) == [0, 1, 1]
