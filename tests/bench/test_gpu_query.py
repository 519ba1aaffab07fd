"""What the benchmarks ask ``nvidia-smi``: a GPU query answers for the GPUs the process was given."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from benchmarks.gpu_query import cuda_mib_by_pid, used_mib_by_gpu


def fake_nvidia_smi(directory: Path) -> None:
    """``nvidia-smi`` of a host with GPUs 0-2 (using 100, 200, 300 MiB; GPU 1's UUID is GPU-0001) and
    process 11 on GPUs 1 and 2, 12 on GPU 1, 13 on GPU 2."""
    directory.mkdir()
    program = directory / "nvidia-smi"
    program.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '"--query-gpu=memory.used --format=csv,noheader,nounits") printf "100\\n200\\n300\\n" ;;\n'
        '"--query-gpu=memory.used --id=1 --format=csv,noheader,nounits") echo 200 ;;\n'
        '"--query-gpu=memory.used --id=2,GPU-0000 --format=csv,noheader,nounits") printf "300\\n100\\n" ;;\n'
        '"--query-gpu=uuid --id=1 --format=csv,noheader,nounits") echo GPU-0001 ;;\n'
        '"--query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits")'
        ' printf "11, 50, GPU-0001\\n12, 70, GPU-0001\\n13, 90, GPU-0002\\n11, 5, GPU-0002\\n" ;;\n'
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
def test_processes_count_on_the_gpus_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack on another GPU of the host (the soak beside a benchmark) is left out."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_mib_by_pid() == {11: 55, 12: 70, 13: 90}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert cuda_mib_by_pid() == {11: 50, 12: 70}
