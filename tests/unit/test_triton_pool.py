"""Which server takes a call, which stay in rotation, how long a call tries on, and what a Triton address names
(no Triton server: the readiness probes meet a port with nothing behind it and a socket that never answers, and
a scripted client dies under its calls; the real servers' failover is in ``tests/e2e/test_stream_failover.py``)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.e2e.gateway_process import free_port
from tests.fixtures.silent_server import silent_server
from tts_gateway.gateway.errors import GatewayError, ServerUnavailableError, SynthesisError
from tts_gateway.gateway.metrics import GatewayMetrics
from tts_gateway.gateway.triton.client import Readiness, TritonClient, TritonModelConfig
from tts_gateway.gateway.triton.pool import (
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


class _DyingServer:
    """A client whose server dies under a call: the call in flight fails as the model's error ("Internal
    error from Core"), the next finds nothing listening, and after ``down_s`` it is back and serves."""

    def __init__(self, down_s: float, failures: list[Exception]) -> None:
        self.calls = 0
        self._failures = failures
        self._down_s = down_s
        self._back_at: float | None = None

    def _back(self) -> bool:
        return self._back_at is not None and asyncio.get_running_loop().time() >= self._back_at

    async def readiness(self) -> Readiness:
        return Readiness.READY if self._back() or self._back_at is None else Readiness.NOT_READY

    async def model_configs(self) -> list[TritonModelConfig]:
        return [TritonModelConfig("piper_stream", frozenset(), decoupled=True)]

    async def stream(self, model: str, values: object, request_id: str) -> AsyncIterator[np.ndarray]:
        self.calls += 1
        if self._back_at is None:
            self._back_at = asyncio.get_running_loop().time() + self._down_s
        if not self._back() and self._failures:
            raise self._failures.pop(0)
        if not self._back():
            raise ServerUnavailableError("Triton server is unavailable")
        yield np.ones(4, dtype=np.float32)

    async def close(self) -> None:
        pass


async def _watched(pool: TritonPool, every: float = 0.05) -> asyncio.Task[None]:
    """The readiness probes the gateway runs, at a test's pace."""

    async def watch() -> None:
        while True:
            await pool.refresh()
            await asyncio.sleep(every)

    await pool.refresh()
    return asyncio.create_task(watch())


async def test_a_patient_call_waits_out_a_restart_that_first_failed_it_as_a_model_error() -> None:
    """The only server dies under a patient call: its first failure leaves the server in rotation, the
    second takes it out, and the call goes on once the server is back, within ``failover_wait``."""
    client = _DyingServer(down_s=0.5, failures=[SynthesisError("Internal error from Core")])
    pool = TritonPool(["127.0.0.1:1"], lambda _: client, GatewayMetrics(), failover_wait=5.0)  # type: ignore[arg-type,return-value]
    watcher = await _watched(pool)
    notified: list[bool] = []
    try:
        failover = Failover(skip_sent=False, notify=lambda _exc, mid: notified.append(mid))
        chunks = [c async for c in pool.stream("piper_stream", {}, "r1", patient=True, failover=failover)]
    finally:
        watcher.cancel()
        await pool.close()
    assert [c.size for c in chunks] == [4]
    assert client.calls >= 3 and notified == [False] * (client.calls - 1)


async def test_an_impatient_call_is_sent_once_more_only() -> None:
    client = _DyingServer(down_s=0.5, failures=[SynthesisError("Internal error from Core")])
    pool = TritonPool(["127.0.0.1:1"], lambda _: client, GatewayMetrics(), failover_wait=5.0)  # type: ignore[arg-type,return-value]
    await pool.refresh()
    with pytest.raises(GatewayError):
        async for _ in pool.stream("piper_stream", {}, "r1"):
            pass
    await pool.close()
    assert client.calls == 1, "no other server: the call fails at once"


async def test_a_patient_call_waits_for_a_server_down_no_longer_than_failover_wait() -> None:
    client = _DyingServer(down_s=60, failures=[SynthesisError("Internal error from Core")])
    pool = TritonPool(["127.0.0.1:1"], lambda _: client, GatewayMetrics(), failover_wait=0.5)  # type: ignore[arg-type,return-value]
    watcher = await _watched(pool)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(ServerUnavailableError):
            async for _ in pool.stream("piper_stream", {}, "r1", patient=True):
                pass
    finally:
        watcher.cancel()
        await pool.close()
    assert 0.5 <= loop.time() - started < 2.0
    assert client.calls == 2, "down: the call waited for it to be ready again"


async def test_a_model_that_fails_twice_is_not_asked_again_even_by_a_patient_call() -> None:
    """Each restart of a stream after its first audio repeats audio: a model that fails it is tried twice."""
    client = _DyingServer(down_s=60, failures=[SynthesisError("model broke") for _ in range(3)])
    pool = TritonPool(["127.0.0.1:1"], lambda _: client, GatewayMetrics(), failover_wait=5.0)  # type: ignore[arg-type,return-value]
    await pool.refresh()
    with pytest.raises(SynthesisError, match="model broke"):
        async for _ in pool.stream("piper_stream", {}, "r1", patient=True):
            pass
    await pool.close()
    assert client.calls == 2
