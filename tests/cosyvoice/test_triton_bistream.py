"""Text-streaming sessions end to end: the gateway's TextStreamCall against a real tritonserver.

The cosyvoice2-cpu profile over the tiny checkpoint deploys ``cosyvoice2_bistream`` (two orchestrator
instances, Triton's sequence batcher sending each session's requests to the one holding it) next to
the PyTorch LLM that interleaves text and speech. With random weights the audio is noise; the checks
are about the session: audio before the text is complete, a clean end, pieces refused after it, a
cancelled session's LLM request ended at once, pieces reaching their session's instance, every
session giving its place in the batcher back however it ends, and a full model refusing one more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import tritonclient.grpc as syncclient
from numpy.typing import NDArray

from tests.conftest import CosyVoiceServer
from tts_gateway.gateway.errors import InvalidRequestError, RateLimitError
from tts_gateway.gateway.triton.client import TritonClient
from tts_gateway.gateway.triton.model_catalog import ModelCatalog
from tts_gateway.gateway.triton.text_stream_call import TextStreamCall
from tts_gateway.models import contract
from tts_gateway.paths import REFERENCE_VOICES

# The gRPC client and its streams live in the loop of the fixtures (session-scoped).
pytestmark = [pytest.mark.cosyvoice, pytest.mark.triton, pytest.mark.asyncio(loop_scope="session")]

MODEL = "cosyvoice2_bistream"
SAMPLES_PER_TOKEN = 960
PIECES = ["The quick brown fox ", "jumps over the lazy dog ", "near the river bank, ", "and then it rests ", "a while."]


@pytest.fixture(scope="module")
def voice() -> dict[str, object]:
    audio, rate = sf.read(REFERENCE_VOICES / "harbor.wav", dtype="float32", always_2d=True)
    wav = soxr.resample(audio.mean(axis=1), rate, contract.REFERENCE_SAMPLE_RATE).astype(np.float32)
    wav = wav[: 4 * contract.REFERENCE_SAMPLE_RATE]
    text = Path(REFERENCE_VOICES / "harbor.txt").read_text(encoding="utf-8").strip()
    return {
        contract.REFERENCE_WAV: wav,
        contract.REFERENCE_WAV_LEN: wav.size,
        contract.REFERENCE_TEXT: text,
        contract.SEED: 7,
    }


@pytest.fixture(scope="module")
async def client(cosyvoice_server: CosyVoiceServer) -> AsyncIterator[TritonClient]:
    client = TritonClient(cosyvoice_server.triton.grpc_url, timeout=30.0)
    yield client
    await client.close()


async def _collect(session: TextStreamCall, into: list[tuple[float, NDArray[np.float32]]]) -> None:
    async for chunk in session:
        into.append((time.monotonic(), chunk))


async def test_the_catalog_sees_the_text_streaming_deployment(cosyvoice_server: CosyVoiceServer) -> None:
    triton = TritonClient(cosyvoice_server.triton.grpc_url, timeout=30.0)
    try:
        catalog = ModelCatalog.from_triton(await triton.model_configs())
    finally:
        await triton.close()
    assert MODEL not in catalog.models
    assert catalog.models["cosyvoice2"].text_stream_model == MODEL


async def test_audio_arrives_while_the_text_still_comes(client: TritonClient, voice: dict[str, object]) -> None:
    session = await TextStreamCall.open(client, MODEL, "first-session", voice)
    chunks: list[tuple[float, NDArray[np.float32]]] = []
    reader = asyncio.create_task(_collect(session, chunks))
    sent_last = 0.0
    for piece in PIECES:
        await session.send_text(piece)
        # Give the session time to speak what it has before the next piece.
        for _ in range(100):
            if chunks or reader.done():
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        sent_last = time.monotonic()
    await session.finish()
    await asyncio.wait_for(reader, 120)
    assert chunks, "no audio"
    assert chunks[0][0] < sent_last, "the first audio came only after the last piece"
    audio = np.concatenate([chunk for _, chunk in chunks])
    assert audio.dtype == np.float32 and np.isfinite(audio).all()
    assert audio.size % SAMPLES_PER_TOKEN == 0
    with pytest.raises(InvalidRequestError):
        await session.send_text("too late")
    await session.cancel()


def _llm_requests_done(server: CosyVoiceServer) -> int:
    client = syncclient.InferenceServerClient(server.triton.grpc_url)
    try:
        stats = client.get_inference_statistics("llm", as_json=True)
    finally:
        client.close()
    inference = stats["model_stats"][0]["inference_stats"]
    return sum(int(inference[kind].get("count", 0)) for kind in ("success", "fail"))


async def test_a_cancelled_session_ends_its_llm_request(
    client: TritonClient, voice: dict[str, object], cosyvoice_server: CosyVoiceServer
) -> None:
    session = await TextStreamCall.open(client, MODEL, "cancelled-session", voice)
    chunks: list[tuple[float, NDArray[np.float32]]] = []
    reader = asyncio.create_task(_collect(session, chunks))
    await session.send_text(PIECES[0])
    # The LLM stream waits for more text now (a slot given back, its cache aside).
    for _ in range(600):
        if chunks:
            break
        await asyncio.sleep(0.1)
    done_before = _llm_requests_done(cosyvoice_server)
    await session.cancel()
    await asyncio.wait_for(reader, 30)
    for _ in range(100):
        if _llm_requests_done(cosyvoice_server) > done_before:
            break
        await asyncio.sleep(0.1)
    assert _llm_requests_done(cosyvoice_server) > done_before, "the LLM still holds the cancelled session"
    # The session id is free again, and a new session under it runs to its end.
    again = await TextStreamCall.open(client, MODEL, "cancelled-session", voice)
    await again.send_text(PIECES[1])
    await again.finish()
    audio = [chunk async for chunk in again]
    assert audio
    await again.cancel()


async def test_a_session_id_in_use_is_refused(client: TritonClient, voice: dict[str, object]) -> None:
    session = await TextStreamCall.open(client, MODEL, "twice", voice)
    try:
        with pytest.raises(InvalidRequestError, match="open already"):
            await TextStreamCall.open(client, MODEL, "twice", voice)
        # The refused opening left the session that holds the id (and its sequence) as it was.
        await session.send_text(PIECES[0])
        await session.finish()
        assert [chunk async for chunk in session]
    finally:
        await session.cancel()


async def test_text_for_a_session_not_open_is_refused(client: TritonClient) -> None:
    stranger = TextStreamCall(client, MODEL, "never-opened")
    with pytest.raises(InvalidRequestError, match="no open session"):
        await stranger.send_text("hello")


async def test_sessions_on_both_instances_get_their_pieces(client: TritonClient, voice: dict[str, object]) -> None:
    # The batcher places sessions round the two instances; a piece sent to the other one would be refused there
    # (no open session).
    sessions = [await TextStreamCall.open(client, MODEL, f"spread-{n}", voice) for n in range(4)]
    audio: list[list[tuple[float, NDArray[np.float32]]]] = [[] for _ in sessions]
    readers = [asyncio.create_task(_collect(session, chunks)) for session, chunks in zip(sessions, audio, strict=True)]
    for piece in PIECES[:3]:
        for session in sessions:
            await session.send_text(piece)
    for session in sessions:
        await session.finish()
    await asyncio.wait_for(asyncio.gather(*readers), 300)
    assert all(chunks for chunks in audio), [len(chunks) for chunks in audio]
    for session in sessions:
        await session.cancel()


async def test_every_ended_session_gives_its_place_back(client: TritonClient, voice: dict[str, object]) -> None:
    # More sessions one after another than the batcher has places (2 instances x 4): without the close that ends
    # each one's sequence, the 9th would find no place.
    for n in range(40):
        session = await TextStreamCall.open(client, MODEL, f"place-{n}", voice, place_wait_s=5)
        if n % 8:
            await session.cancel()
        else:  # ends by itself; its owner then awaits the close its end started
            await session.finish()
            async for _ in session:
                pass
            await session.cancel()


async def test_failed_openings_give_their_place_back(client: TritonClient, voice: dict[str, object]) -> None:
    # Without a voice the request opens no session: the model refuses it after Triton gave its sequence a place.
    for n in range(20):
        with pytest.raises(InvalidRequestError, match="no open session"):
            await TextStreamCall.open(client, MODEL, f"voiceless-{n}", {contract.SEED: 1}, place_wait_s=5)
    session = await TextStreamCall.open(client, MODEL, "after-the-failures", voice, place_wait_s=5)
    await session.cancel()


async def test_a_full_model_refuses_the_next_session_for_now(client: TritonClient, voice: dict[str, object]) -> None:
    places = 2 * 4
    sessions = [await TextStreamCall.open(client, MODEL, f"full-{n}", voice, place_wait_s=1) for n in range(places)]
    try:
        # The opening's wait for a place is over; the sessions it opened run on.
        await asyncio.sleep(2)
        with pytest.raises(RateLimitError, match="as many sessions as it can"):
            await TextStreamCall.open(client, MODEL, "one-too-many", voice, place_wait_s=1)
        await sessions[0].send_text(PIECES[0])
        await sessions[0].finish()
        assert [chunk async for chunk in sessions[0]]
    finally:
        for session in sessions:
            await session.cancel()
    again = await TextStreamCall.open(client, MODEL, "one-too-many", voice, place_wait_s=5)
    await again.cancel()
