"""Validation rules of the contract request, as every model.py sees them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from tts_gateway.models import contract
from tts_gateway.models.request_parsing import ContractError, SynthesisRequest, parse_synthesis_request


def text(value: str | bytes) -> NDArray[np.object_]:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return np.array([raw], dtype=np.object_)


def fp32(value: float) -> NDArray[np.float32]:
    return np.array([value], dtype=np.float32)


def request(**tensors: NDArray[Any]) -> SynthesisRequest:
    return parse_synthesis_request({contract.TARGET_TEXT: text("Hello there."), **tensors})


def test_minimal_request_gets_defaults() -> None:
    parsed = request()
    assert parsed.target_text == "Hello there."
    assert parsed.reference_wav is None
    assert parsed.reference_text is None
    assert parsed.speed == 1.0
    assert (parsed.seed, parsed.temperature, parsed.top_p, parsed.top_k, parsed.voice) == (None,) * 5


def test_instructions_are_optional_and_blank_means_none() -> None:
    assert request().instructions is None
    assert request(instructions=text("  Speak softly. ")).instructions == "Speak softly."
    assert request(instructions=text("   ")).instructions is None


def test_full_request_is_parsed() -> None:
    wav = np.linspace(-0.5, 0.5, 16_000, dtype=np.float32)
    parsed = request(
        reference_wav=wav,
        reference_wav_len=np.array([8_000], dtype=np.int32),
        reference_text=text("Zwölf Boxkämpfer"),
        speed=fp32(1.5),
        seed=np.array([42], dtype=np.int64),
        temperature=fp32(0.8),
        top_p=fp32(0.9),
        top_k=np.array([25], dtype=np.int32),
        voice=text("joe"),
    )
    assert parsed.reference_wav is not None
    assert parsed.reference_wav.dtype == np.float32
    np.testing.assert_array_equal(parsed.reference_wav, wav[:8_000])
    assert parsed.reference_text == "Zwölf Boxkämpfer"
    assert parsed.speed == 1.5
    assert parsed.seed == 42
    assert parsed.temperature == pytest.approx(0.8)
    assert parsed.top_p == pytest.approx(0.9)
    assert parsed.top_k == 25
    assert parsed.voice == "joe"


def test_text_may_arrive_as_str_or_fixed_width_bytes() -> None:
    assert parse_synthesis_request({"target_text": np.array(["Hi."], dtype=np.object_)}).target_text == "Hi."
    assert parse_synthesis_request({"target_text": np.array([b"Hi."])}).target_text == "Hi."


def test_target_text_is_required() -> None:
    with pytest.raises(ContractError, match="'target_text' is required"):
        parse_synthesis_request({contract.SPEED: fp32(1.0)})


@pytest.mark.parametrize("value", ["", "   \n\t"])
def test_target_text_must_not_be_blank(value: str) -> None:
    with pytest.raises(ContractError, match="empty"):
        parse_synthesis_request({contract.TARGET_TEXT: text(value)})


def test_target_text_must_be_utf8() -> None:
    with pytest.raises(ContractError, match="not valid UTF-8"):
        parse_synthesis_request({contract.TARGET_TEXT: text(b"caf\xe9")})


def test_target_text_must_be_one_element() -> None:
    with pytest.raises(ContractError, match="exactly one element"):
        parse_synthesis_request({contract.TARGET_TEXT: np.array([b"a", b"b"], dtype=np.object_)})


def test_target_text_must_be_bytes() -> None:
    with pytest.raises(ContractError, match="must be BYTES"):
        parse_synthesis_request({contract.TARGET_TEXT: np.array([3], dtype=np.int32)})


def test_reference_wav_without_length_is_used_whole() -> None:
    wav = np.zeros(100, dtype=np.float32)
    parsed = request(reference_wav=wav)
    assert parsed.reference_wav is not None
    assert parsed.reference_wav.shape == (100,)


@pytest.mark.parametrize("length", [0, -1, 101])
def test_reference_wav_len_must_lie_within_the_array(length: int) -> None:
    with pytest.raises(ContractError, match=r"reference_wav_len' must be in \[1, 100\]"):
        request(
            reference_wav=np.zeros(100, dtype=np.float32),
            reference_wav_len=np.array([length], dtype=np.int32),
        )


def test_reference_wav_len_needs_reference_wav() -> None:
    with pytest.raises(ContractError, match="without 'reference_wav'"):
        request(reference_wav_len=np.array([10], dtype=np.int32))


def test_reference_wav_must_be_one_dimensional() -> None:
    with pytest.raises(ContractError, match="one-dimensional"):
        request(reference_wav=np.zeros((2, 50), dtype=np.float32))


def test_reference_wav_must_be_float() -> None:
    with pytest.raises(ContractError, match="must be FP32"):
        request(reference_wav=np.zeros(50, dtype=np.int16))


def test_reference_wav_must_be_finite_within_its_valid_length() -> None:
    wav = np.zeros(100, dtype=np.float32)
    wav[80] = np.nan
    # Padding past reference_wav_len is not looked at.
    parsed = request(reference_wav=wav, reference_wav_len=np.array([50], dtype=np.int32))
    assert parsed.reference_wav is not None
    with pytest.raises(ContractError, match="NaN or infinite"):
        request(reference_wav=wav)


def test_reference_text_needs_reference_wav() -> None:
    with pytest.raises(ContractError, match="needs 'reference_wav'"):
        request(reference_text=text("a transcript"))


def test_blank_reference_text_means_none() -> None:
    parsed = request(reference_wav=np.zeros(10, dtype=np.float32), reference_text=text("  "))
    assert parsed.reference_text is None


@pytest.mark.parametrize("speed", [0.25, 1.0, 4.0])
def test_speed_accepts_the_openai_range(speed: float) -> None:
    assert request(speed=fp32(speed)).speed == speed


@pytest.mark.parametrize("speed", [0.0, 0.2, 4.01, -1.0, float("nan"), float("inf")])
def test_speed_outside_the_range_is_rejected(speed: float) -> None:
    with pytest.raises(ContractError, match="speed"):
        request(speed=fp32(speed))


def test_speed_must_be_float() -> None:
    with pytest.raises(ContractError, match="must be a float"):
        request(speed=np.array([2], dtype=np.int32))


@pytest.mark.parametrize("seed", [0, 2**63 - 1])
def test_seed_bounds_are_accepted(seed: int) -> None:
    assert request(seed=np.array([seed], dtype=np.int64)).seed == seed


def test_negative_seed_is_rejected() -> None:
    with pytest.raises(ContractError, match="'seed'"):
        request(seed=np.array([-1], dtype=np.int64))


def test_seed_must_be_integer() -> None:
    with pytest.raises(ContractError, match="must be an integer"):
        request(seed=fp32(1.0))


@pytest.mark.parametrize("value", [0.0, -0.1, 2.5])
def test_temperature_out_of_range_is_rejected(value: float) -> None:
    with pytest.raises(ContractError, match="'temperature'"):
        request(temperature=fp32(value))


def test_temperature_upper_bound_is_accepted() -> None:
    assert request(temperature=fp32(2.0)).temperature == 2.0


@pytest.mark.parametrize("value", [0.0, -0.5, 1.01])
def test_top_p_out_of_range_is_rejected(value: float) -> None:
    with pytest.raises(ContractError, match="'top_p'"):
        request(top_p=fp32(value))


def test_top_p_of_one_is_accepted() -> None:
    assert request(top_p=fp32(1.0)).top_p == 1.0


@pytest.mark.parametrize("value", [0, -3])
def test_top_k_below_one_is_rejected(value: int) -> None:
    with pytest.raises(ContractError, match="'top_k'"):
        request(top_k=np.array([value], dtype=np.int32))


def test_top_k_must_be_integer() -> None:
    with pytest.raises(ContractError, match="must be an integer"):
        request(top_k=np.array([True]))


def test_voice_must_not_be_blank() -> None:
    with pytest.raises(ContractError, match="'voice' is empty"):
        request(voice=text(""))


def test_contract_error_is_a_value_error() -> None:
    assert issubclass(ContractError, ValueError)
