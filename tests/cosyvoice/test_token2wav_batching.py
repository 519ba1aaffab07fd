"""Token2Wav.convert: calls converted together give what each gives alone, and fail one by one."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

from tts_gateway.models.cosyvoice2.engines.token2wav import Conversion, StreamStateError, Token2Wav
from tts_gateway.models.cosyvoice2.model.frontend import VoicePrompt

pytestmark = pytest.mark.cosyvoice

LOOKAHEAD = 3


@pytest.fixture(scope="module")
def t2w(token2wav_dir: Path) -> Token2Wav:
    return Token2Wav.from_model_dir(token2wav_dir, device="cpu", dtype=torch.float32)


def voice(seed: int, tokens: int) -> VoicePrompt:
    rng = np.random.default_rng(seed)
    return VoicePrompt(
        speech_tokens=rng.integers(0, 6561, tokens),
        feats=rng.standard_normal((2 * tokens, 80)).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )


def tokens(count: int, seed: int) -> NDArray[np.int64]:
    return np.random.default_rng(100 + seed).integers(0, 6561, count)


def two_streams_in_step(t2w: Token2Wav, name: str, prompt: VoicePrompt, tokens: NDArray[np.int64]) -> list[Any]:
    """The audio of two streams ``name-0`` and ``name-1`` converted in step, one batch a chunk: a first hop of 15
    tokens, then 25, then the final chunk (60 ``tokens`` in all)."""
    chunks = []
    for offset, end, final in ((0, 18, False), (15, 43, False), (40, 60, True)):
        batch = [Conversion(f"{name}-{n}", tokens[:end], prompt, offset, final) for n in range(2)]
        results = t2w.convert(batch)
        assert all(isinstance(result, np.ndarray) for result in results)
        chunks.append(np.concatenate(results))
    return chunks


def calls(tag: str) -> list[Conversion]:
    """A mix as a busy server sees it: first chunks, a later chunk, a final chunk, offline calls, two voices."""
    a, b = voice(1, 10), voice(2, 17)
    return [
        Conversion(f"{tag}-first-a", tokens(18, 1), a, 0, False),
        Conversion(f"{tag}-first-b", tokens(21, 2), b, 0, False),
        Conversion(f"{tag}-final", tokens(9, 3), a, 0, True),
        Conversion(f"{tag}-offline", tokens(40, 4), b),
        Conversion(f"{tag}-offline-slow", tokens(25, 5), a, speed=0.8),
        Conversion(f"{tag}-first-c", tokens(18, 6), b, 0, False),
    ]


def test_a_batch_converts_each_call_as_it_would_be_converted_alone(t2w: Token2Wav) -> None:
    alone = [t2w.convert([call])[0] for call in calls("alone")]
    together = t2w.convert(calls("together"))
    for single, batched in zip(alone, together, strict=True):
        assert isinstance(single, np.ndarray) and isinstance(batched, np.ndarray)
        assert single.shape == batched.shape
        np.testing.assert_allclose(batched, single, atol=2e-4)
    # Later chunks of the streams opened together continue as they would alone.
    follow = [
        Conversion("alone-first-a", tokens(43, 1), voice(1, 10), 15, True),
        Conversion("together-first-a", tokens(43, 1), voice(1, 10), 15, True),
    ]
    single, batched = t2w.convert(follow)
    assert isinstance(single, np.ndarray) and isinstance(batched, np.ndarray)
    np.testing.assert_allclose(batched, single, atol=2e-4)
    for tag in ("alone", "together"):
        t2w.release(f"{tag}-first-b")
        t2w.release(f"{tag}-first-c")
    assert t2w.active_streams == 0


def test_a_bad_call_fails_alone(t2w: Token2Wav) -> None:
    good = Conversion("good", tokens(18, 1), voice(1, 10), 0, False)
    unknown = Conversion("unknown", tokens(30, 2), voice(1, 10), 12, False)
    short = Conversion("short", tokens(4, 3), voice(1, 10), 2, False)
    a = voice(1, 10)
    wrong_voice = Conversion(
        "wrong-voice",
        tokens(18, 4),
        VoicePrompt(speech_tokens=a.speech_tokens, feats=a.feats, embedding=np.zeros(64, dtype=np.float32)),
        0,
        False,
    )
    out_of_range = Conversion("out-of-range", np.array([1, 2, 99999] * 6), voice(1, 10), 0, False)
    results = t2w.convert([good, unknown, short, wrong_voice, out_of_range])
    assert isinstance(results[0], np.ndarray) and results[0].size > 0
    assert isinstance(results[1], StreamStateError)
    assert isinstance(results[2], ValueError) and "look-ahead" in str(results[2])
    assert isinstance(results[3], ValueError) and "embedding" in str(results[3])
    assert isinstance(results[4], ValueError) and "below" in str(results[4])
    t2w.release("good")
    assert t2w.active_streams == 0


def test_first_chunks_are_converted_and_answered_before_the_rest_of_their_batch(
    t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's first audio waits on nothing else in its batch: a group is answered before the next one runs."""
    events: list[str] = []
    flow_batch = t2w.flow.inference_batch

    def logged(items: list[Any], **kwargs: Any) -> list[torch.Tensor]:
        events.append(f"flow {len(items)}")
        return flow_batch(items, **kwargs)

    monkeypatch.setattr(t2w.flow, "inference_batch", logged)
    a, b = voice(1, 10), voice(2, 17)
    later = Conversion("order-later", tokens(43, 1), a, 15, False)
    t2w.convert([Conversion("order-later", tokens(18, 1), a, 0, False)])  # opens the later stream
    events.clear()
    batch = [
        Conversion("order-offline", tokens(40, 4), b),
        later,
        Conversion("order-first-a", tokens(18, 2), a, 0, False),
        Conversion("order-first-b", tokens(21, 3), b, 0, False),
        Conversion("order-bad", tokens(4, 5), a, 2, False),
    ]
    results = t2w.convert(batch, lambda index, result: events.append(f"answer {batch[index].session_id}"))
    # The bad call is answered at once, both first chunks (one flow pass) before the rest is converted.
    assert events == [
        "answer order-bad",
        "flow 2",
        "answer order-first-a",
        "answer order-first-b",
        "flow 2",
        "answer order-offline",
        "answer order-later",
    ]
    assert all(isinstance(result, np.ndarray) and result.size > 0 for result in results[:4])
    assert isinstance(results[4], ValueError)
    for session in ("order-later", "order-first-a", "order-first-b"):
        t2w.release(session)
    assert t2w.active_streams == 0


def test_calls_close_in_length_share_a_flow_pass_wherever_their_lengths_fall(
    t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt and tokens of 124 and 128 (two voices' first chunks) go in one pass; 260 is too far from them."""
    passes: list[int] = []
    flow_batch = t2w.flow.inference_batch

    def counted(items: list[Any], **kwargs: Any) -> list[torch.Tensor]:
        passes.append(len(items))
        return flow_batch(items, **kwargs)

    monkeypatch.setattr(t2w.flow, "inference_batch", counted)
    short, long = voice(3, 99), voice(4, 103)
    batch = [
        Conversion("span-a", tokens(25, 1), short, 0, False),
        Conversion("span-b", tokens(25, 2), long, 0, False),
        Conversion("span-c", tokens(25, 3), short, 0, False),
        Conversion("span-far", tokens(161, 4), short, 0, True),
    ]
    results = t2w.convert(batch)
    assert passes == [3, 1]
    assert all(isinstance(result, np.ndarray) and result.size > 0 for result in results)
    for session in ("span-a", "span-b", "span-c"):
        t2w.release(session)
    assert t2w.active_streams == 0


def test_a_failing_group_fails_the_calls_not_answered_yet_and_drops_their_streams(
    t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    flow_batch = t2w.flow.inference_batch
    passes: list[int] = []

    def second_pass_fails(items: list[Any], **kwargs: Any) -> list[torch.Tensor]:
        passes.append(len(items))
        if len(passes) == 2:
            raise RuntimeError("out of memory")
        return flow_batch(items, **kwargs)

    monkeypatch.setattr(t2w.flow, "inference_batch", second_pass_fails)
    batch = [
        Conversion("fail-first", tokens(18, 1), voice(1, 10), 0, False),
        Conversion("fail-long", tokens(300, 2), voice(1, 10), 0, True),
    ]
    answered: list[int] = []
    with pytest.raises(RuntimeError, match="out of memory"):
        t2w.convert(batch, lambda index, result: answered.append(index))
    assert answered == [0]
    # The answered first chunk's stream goes on; the failed call's state is gone.
    assert t2w.active_streams == 1
    monkeypatch.setattr(t2w.flow, "inference_batch", flow_batch)
    (rest,) = t2w.convert([Conversion("fail-first", tokens(30, 1), voice(1, 10), 15, True)])
    assert isinstance(rest, np.ndarray) and rest.size > 0
    assert t2w.active_streams == 0


def test_calls_of_different_lengths_are_vocoded_in_one_call_per_excitation_cache(
    t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's mels of any length are padded into one HiFT call (streams' first chunks are one group,
    the rest another); streams' later chunks, which continue a cached excitation, make a call of their own."""
    vocoded: list[tuple[int, bool]] = []
    vocode = t2w.hift.vocode

    def counting(mel: torch.Tensor, *args: Any) -> Any:
        vocoded.append((mel.shape[0], args[1] is not None))
        return vocode(mel, *args)

    monkeypatch.setattr(t2w.hift, "vocode", counting)
    results = t2w.convert(calls("lengths"))
    assert all(isinstance(result, np.ndarray) for result in results)
    assert vocoded == [(4, False), (2, False)]
    vocoded.clear()
    later = [
        Conversion("lengths-first-a", tokens(43, 1), voice(1, 10), 15, False),
        Conversion("lengths-first-b", tokens(50, 2), voice(2, 17), 18, True),
        Conversion("lengths-offline-2", tokens(33, 7), voice(1, 10)),
    ]
    results = t2w.convert(later)
    assert all(isinstance(result, np.ndarray) for result in results)
    assert sorted(vocoded) == [(1, False), (2, True)]
    for stream in ("lengths-first-a", "lengths-first-c"):
        t2w.release(stream)
    assert t2w.active_streams == 0


def test_a_mel_much_longer_than_the_rest_is_vocoded_apart() -> None:
    """Padding short chunks to one long final chunk would cost more than the call it saves."""
    from tts_gateway.models.cosyvoice2.engines.token2wav import _padding_batches

    def part(index: int, rows: int, frames: int) -> tuple[list[int], torch.Tensor, list[torch.Generator], None]:
        return [index], torch.zeros(rows, 80, frames), [torch.Generator() for _ in range(rows)], None

    spread = [part(i, 1, frames) for i, frames in enumerate((110, 40, 75, 58, 90))]
    assert [[p[0] for p in batch] for batch in _padding_batches(spread)] == [[[1], [3], [2], [4], [0]]]
    lopsided = [part(0, 31, 58), part(1, 1, 300), part(2, 2, 70)]
    assert [[p[0] for p in batch] for batch in _padding_batches(lopsided)] == [[[0], [2]], [[1]]]


def test_a_large_eager_vocoding_is_made_in_slices_of_rows_that_sound_as_one_call(
    t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows x frames beyond EAGER_HIFT_ROW_FRAMES go to HiFT a few rows at a time, each slice's noise drawn
    for it alone (HiFT's memory, and the noise's, grow with both); each row's audio and excitation are what
    one padded call with the whole batch's noise gives."""
    from tts_gateway.models.cosyvoice2.engines import token2wav
    from tts_gateway.models.cosyvoice2.model.hift import ExcitationNoise

    hift = t2w.hift
    generator = torch.Generator().manual_seed(3)
    shapes = ((2, 30), (1, 22), (2, 26))
    mels = [torch.randn(rows, 80, frames, generator=generator) for rows, frames in shapes]
    caches = [torch.randn(rows, 1, 2 * hift.samples_per_frame, generator=generator) for rows, _ in shapes]

    def seeded(part: int, rows: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(10 * part + row) for row in range(rows)]

    with torch.inference_mode():
        noises = [hift.draw_noise(mel.shape[0], mel.shape[2], seeded(i, mel.shape[0])) for i, mel in enumerate(mels)]
        mel, noise, frames = hift.padded(mels, noises)
        whole = hift.vocode(mel, noise, torch.cat(caches), frames)
        del noises, noise
        calls: list[int] = []
        drawn: list[int] = []
        held: list[tuple[int, int]] = []
        vocode, draw_noise = hift.vocode, hift.draw_noise

        def counting(mel: torch.Tensor, noise: ExcitationNoise, *args: Any) -> Any:
            calls.append(mel.shape[0])
            # Every noise tensor alive while HiFT runs (storages, once each): the slice's own and no other.
            alive = {
                obj.untyped_storage().data_ptr(): obj.untyped_storage().nbytes()
                for obj in gc.get_objects()
                if type(obj) is torch.Tensor and obj.dim() == 3 and obj.shape[1] == noise.gaussian.shape[1] > 1
            }
            held.append((sum(alive.values()), noise.gaussian.untyped_storage().nbytes()))
            return vocode(mel, noise, *args)

        def counting_draws(rows: int, frames: int, *args: Any) -> Any:
            drawn.append(rows * frames)
            return draw_noise(rows, frames, *args)

        monkeypatch.setattr(hift, "vocode", counting)
        monkeypatch.setattr(hift, "draw_noise", counting_draws)
        monkeypatch.setattr(token2wav, "EAGER_HIFT_ROW_FRAMES", 2 * 30)
        members = [[0, 1], [2], [3, 4]]
        parts = [
            (indices, part_mel, seeded(i, part_mel.shape[0]), cache)
            for i, (indices, part_mel, cache) in enumerate(zip(members, mels, caches, strict=True))
        ]
        sliced = sorted(token2wav._vocode_in_slices(hift, parts), key=lambda result: result[0])
    assert calls == [2, 2, 1]
    # Noise drawn row by row for the slice being vocoded, never for more rows at once.
    assert drawn == [30, 30, 22, 26, 26]
    assert all(alive == own for alive, own in held), held
    assert [index for index, _, _ in sliced] == [0, 1, 2, 3, 4]
    lengths = [frames for rows, frames in shapes for _ in range(rows)]
    for (_, wav, source), row, length in zip(sliced, range(5), lengths, strict=True):
        samples = length * hift.samples_per_frame
        assert wav.shape == (samples,) and source.shape == (1, 1, samples)
        torch.testing.assert_close(wav, whole[0][row, :samples], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(source, whole[1][row : row + 1, :, :samples], rtol=1e-4, atol=1e-5)


def test_later_chunks_of_different_lengths_vocoded_together_sound_as_alone(t2w: Token2Wav) -> None:
    """Two streams' later chunks (each continuing its own cached excitation), one longer: padded into one
    HiFT call, each gives the audio it gives converted alone."""
    a, b = voice(1, 10), voice(2, 17)
    for tag in ("alone", "together"):
        opened = t2w.convert(
            [Conversion(f"{tag}-a", tokens(18, 1), a, 0, False), Conversion(f"{tag}-b", tokens(18, 2), b, 0, False)]
        )
        assert all(isinstance(result, np.ndarray) for result in opened)
    short = lambda tag: Conversion(f"{tag}-a", tokens(43, 1), a, 15, False)  # noqa: E731
    long = lambda tag: Conversion(f"{tag}-b", tokens(60, 2), b, 15, True)  # noqa: E731
    alone = [t2w.convert([short("alone")])[0], t2w.convert([long("alone")])[0]]
    together = t2w.convert([short("together"), long("together")])
    for single, batched in zip(alone, together, strict=True):
        assert isinstance(single, np.ndarray) and isinstance(batched, np.ndarray)
        assert single.shape == batched.shape
        np.testing.assert_allclose(batched, single, atol=1e-5)
    for tag in ("alone", "together"):
        t2w.release(f"{tag}-a")
    assert t2w.active_streams == 0
