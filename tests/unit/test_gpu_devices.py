"""Which GPUs the embedded servers are spread over (``TTS_EMBEDDED_GPUS``)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tts_gateway.gateway.embedded.gpu_devices import cuda_ids, server_gpus, visible_gpus
from tts_gateway.gateway.settings import Settings, parse_gpu_setting


def fake_nvidia_smi(directory: Path, indices: list[int], status: int = 0) -> Path:
    """``nvidia-smi`` answering the two queries asked of it: indices, and indices with UUIDs."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "nvidia-smi"
    indexes = "".join(f"echo {index}\n" for index in indices)
    uuids = "".join(f"echo '{index}, GPU-{index:04x}'\n" for index in indices)
    program.write_text(
        "#!/bin/sh\n"
        f'if [ "$*" = "--query-gpu=index --format=csv,noheader" ]; then\n{indexes}exit {status}; fi\n'
        f'if [ "$*" = "--query-gpu=index,uuid --format=csv,noheader" ]; then\n{uuids}exit {status}; fi\n'
        "exit 9\n"
    )
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return directory


@pytest.mark.parametrize(
    ("value", "normalised"),
    [("auto", "auto"), (" none ", "none"), ("0", "0"), ("0, 1", "0,1"), ("GPU-5e0c,GPU-77aa", "GPU-5e0c,GPU-77aa")],
)
def test_settings_accept_auto_none_and_gpu_ids(value: str, normalised: str) -> None:
    assert parse_gpu_setting(value) == normalised
    assert Settings(embedded_gpus=value).embedded_gpus == normalised


@pytest.mark.parametrize("value", ["", "0,,1", "0,0", "0 1", "all"])
def test_settings_refuse_anything_else(value: str) -> None:
    with pytest.raises(ValueError, match="TTS_EMBEDDED_GPUS"):
        Settings(embedded_gpus=value)


def test_visible_devices_come_from_cuda_visible_devices_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "bin", [0, 1, 2, 3])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-77aa")
    assert visible_gpus() == ["2", "GPU-77aa"]
    # CUDA reads up to the first entry that names no device.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,-1,0")
    assert visible_gpus() == ["3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ["0", "1", "2", "3"]


def test_no_driver_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert visible_gpus() == []
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "broken", [0], status=6)))
    assert visible_gpus() == []


def test_a_gpu_profile_gets_a_server_per_gpu_and_anything_else_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "two", [0, 1])))
    assert server_gpus("auto", profile_uses_gpu=True) == ["0", "1"]
    assert server_gpus("auto", profile_uses_gpu=False) == [None]
    assert server_gpus("none", profile_uses_gpu=True) == [None]
    assert server_gpus("1", profile_uses_gpu=True) == ["1"]
    assert server_gpus("0,1", profile_uses_gpu=False) == ["0", "1"]
    # One GPU: one server that sees it, as on a single-GPU machine before.
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "one", [0])))
    assert server_gpus("auto", profile_uses_gpu=True) == [None]


def test_the_one_gpu_cuda_visible_devices_names_is_given_to_its_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its server is handed it by UUID: "1" would name another device, or none, to the models under an MPS
    # daemon that sees GPU 1 alone.
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "two", [0, 1])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus = server_gpus("auto", profile_uses_gpu=True)
    assert gpus == ["1"]
    assert cuda_ids(["1"]) == {"1": "GPU-0001"}
    assert server_gpus("auto", profile_uses_gpu=False) == [None]
    # No GPU visible: one server, as without a GPU.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert server_gpus("auto", profile_uses_gpu=True) == [None]


def test_servers_are_handed_their_gpu_by_uuid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "bin", [0, 1])))
    assert cuda_ids(["1", "GPU-77aa", "7"]) == {"1": "GPU-0001", "GPU-77aa": "GPU-77aa", "7": "7"}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cuda_ids(["0"]) == {"0": "0"}
