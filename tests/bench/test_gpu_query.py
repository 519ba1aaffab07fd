"""What the benchmarks ask ``nvidia-smi``: a GPU query answers for the GPUs the process was given."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from benchmarks.gpu_query import cuda_mib_by_pid, used_mib_by_gpu


def fake_nvidia_smi(directory: Path) -> None:
    """``nvidia-smi`` of a host with GPUs 0-2 (using 100, 200, 300 MiB) and two processes on them."""
    directory.mkdir()
    program = directory / "nvidia-smi"
    program.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '"--query-gpu=memory.used --format=csv,noheader,nounits") printf "100\\n200\\n300\\n" ;;\n'
        '"--query-gpu=memory.used --id=1 --format=csv,noheader,nounits") echo 200 ;;\n'
        '"--query-gpu=memory.used --id=2,GPU-0000 --format=csv,noheader,nounits") printf "300\\n100\\n" ;;\n'
        '"--query-compute-apps=pid,used_memory --format=csv,noheader,nounits") printf "11, 50\\n12, 70\\n" ;;\n'
        "*) exit 9 ;;\n"
        "esac\n"
    )
    program.chmod(program.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))


@pytest.mark.usefixtures("host")
def test_gpu_queries_answer_for_every_gpu_unless_cuda_visible_devices_narrows_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert used_mib_by_gpu() == [100, 200, 300]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert used_mib_by_gpu() == [200]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-0000,-1,0")
    assert used_mib_by_gpu() == [300, 100]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert used_mib_by_gpu() == []


@pytest.mark.usefixtures("host")
def test_process_queries_are_not_narrowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes are matched by pid, so every GPU's are listed whatever the process was given."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert cuda_mib_by_pid() == {11: 50, 12: 70}
