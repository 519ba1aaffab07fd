"""The CUDA MPS daemon around the embedded Triton: when it is started, how, and what its clients are told.

No GPU and no NVIDIA driver here: the control program is a stand-in script that records how it was
called (the real one forks the daemon and returns, as the stand-in returns). That the model
processes of a real tritonserver reach the daemon's pipes is tested in tests/triton.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tts_gateway.gateway.embedded.cuda_mps import CONTROL, LOG_VARIABLE, PIPE_VARIABLE, CudaMps, CudaMpsError


def stand_in(directory: Path, status: int = 0) -> Path:
    """A control program that appends its arguments, pipe directory and input to ``calls.log``, and the
    ``CUDA_VISIBLE_DEVICES`` it was given with its arguments to ``devices.log``."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / CONTROL
    program.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=${PIPE_VARIABLE} log=${LOG_VARIABLE} input=$(cat)" >> "{directory}/calls.log"\n'
        f'echo "${{CUDA_VISIBLE_DEVICES-unset}} $*" >> "{directory}/devices.log"\n'
        f"exit {status}\n"
    )
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return program


def stand_in_first_on_path(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in in ``directory``, found before anything else, and no MPS daemon inherited."""
    monkeypatch.setenv("PATH", f"{stand_in(directory).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_VARIABLE, raising=False)


def calls(directory: Path) -> list[str]:
    log = directory / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def devices(directory: Path) -> list[str]:
    log = directory / "devices.log"
    return log.read_text().splitlines() if log.exists() else []


def test_off_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(stand_in(tmp_path / "bin").parent))
    assert CudaMps.for_mode("off", tmp_path / "mps", profile_asks=True) is None


def test_auto_needs_the_control_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(PIPE_VARIABLE, raising=False)
    assert CudaMps.for_mode("auto", tmp_path / "mps", profile_asks=True) is None
    with pytest.raises(CudaMpsError, match="not on PATH"):
        CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True)


def test_auto_starts_nothing_for_a_profile_that_does_not_ask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(stand_in(tmp_path / "bin").parent))
    monkeypatch.delenv(PIPE_VARIABLE, raising=False)
    assert CudaMps.for_mode("auto", tmp_path / "mps", profile_asks=False) is None
    assert CudaMps.for_mode("auto", tmp_path / "mps", profile_asks=True) is not None
    assert CudaMps.for_mode("on", tmp_path / "mps", profile_asks=False) is not None


def test_auto_leaves_a_process_already_under_mps_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(stand_in(tmp_path / "bin").parent))
    monkeypatch.setenv(PIPE_VARIABLE, "/run/nvidia-mps")
    assert CudaMps.for_mode("auto", tmp_path / "mps", profile_asks=True) is None
    assert CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True) is not None


def test_start_runs_a_daemon_of_its_own_and_stop_quits_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    stand_in_first_on_path(bin_dir, monkeypatch)
    mps = CudaMps.for_mode("auto", tmp_path / "mps", profile_asks=True)
    assert mps is not None
    assert mps.env() == {}
    mps.start()
    pipe, log = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    assert pipe.is_dir() and log.is_dir()
    assert mps.env() == {PIPE_VARIABLE: str(pipe), LOG_VARIABLE: str(log)}
    # No daemon had been started in these directories, so nothing was quit before the start.
    assert calls(bin_dir) == [f"args=-d pipe={pipe} log={log} input="]
    mps.stop()
    assert calls(bin_dir)[1:] == [f"args= pipe={pipe} log={log} input=quit"]
    assert mps.env() == {}
    # A second start first quits whatever a crashed owner left running in the same directories.
    mps.start()
    assert calls(bin_dir)[2:] == [f"args= pipe={pipe} log={log} input=quit", f"args=-d pipe={pipe} log={log} input="]


def test_a_daemon_that_does_not_start_is_an_error_only_when_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(stand_in(tmp_path / "bin", status=1).parent))
    monkeypatch.delenv(PIPE_VARIABLE, raising=False)
    required = CudaMps.for_mode("on", tmp_path / "on", profile_asks=True)
    assert required is not None
    with pytest.raises(CudaMpsError, match="exited with status 1"):
        required.start()
    optional = CudaMps.for_mode("auto", tmp_path / "auto", profile_asks=True)
    assert optional is not None
    optional.start()
    assert not optional.running
    assert optional.env() == {}


def test_a_daemon_pinned_to_a_gpu_is_started_seeing_that_gpu_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    stand_in_first_on_path(bin_dir, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pinned = CudaMps.for_mode("on", tmp_path / "mps", profile_asks=False, device="GPU-77aa")
    assert pinned is not None
    pinned.start()
    pinned.stop()
    assert devices(bin_dir) == ["GPU-77aa -d", "GPU-77aa "]
    unpinned = CudaMps.for_mode("on", tmp_path / "all", profile_asks=False)
    assert unpinned is not None
    unpinned.start()
    assert devices(bin_dir)[-1] == "0,1 -d"


def test_a_second_server_on_the_same_directory_is_refused_and_leaves_the_first_daemon_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    stand_in_first_on_path(bin_dir, monkeypatch)
    first = CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True, device="GPU-0")
    second = CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True, device="GPU-1")
    assert first is not None and second is not None
    first.start()
    with pytest.raises(CudaMpsError, match="another running server"):
        second.start()
    second.stop()
    # Only the first server's start reached the control program: nothing quit its daemon.
    assert devices(bin_dir) == ["GPU-0 -d"]
    assert first.running and not second.running
    first.stop()
    second.start()
    assert devices(bin_dir)[1:] == ["GPU-0 ", "GPU-1 ", "GPU-1 -d"]


def test_a_directory_held_by_another_process_is_refused_until_that_process_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner ``exec``s into another program, as ``tts-models launch`` does into tritonserver: the lock stays
    with that program, and ends with it."""
    bin_dir = tmp_path / "bin"
    stand_in_first_on_path(bin_dir, monkeypatch)
    owner = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        from tts_gateway.gateway.embedded.cuda_mps import CudaMps
        mps = CudaMps.for_mode("on", Path(sys.argv[1]), profile_asks=True)
        mps.start()
        mps.keep_across_exec()
        after = "import sys; print('exec', flush=True); sys.stdin.read()"
        os.execvp(sys.executable, [sys.executable, "-c", after])
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", owner, str(tmp_path / "mps")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "exec\n"
        mine = CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True)
        assert mine is not None
        with pytest.raises(CudaMpsError, match="another running server"):
            mine.start()
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)
    mine.start()
    assert mine.running
    # The ended owner's daemon was quit before this process started its own.
    assert calls(bin_dir)[-2:] == [
        f"args= pipe={tmp_path / 'mps' / 'pipe'} log={tmp_path / 'mps' / 'log'} input=quit",
        f"args=-d pipe={tmp_path / 'mps' / 'pipe'} log={tmp_path / 'mps' / 'log'} input=",
    ]


def test_a_server_whose_pipe_directory_vanished_can_stop_and_start_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A temp-file cleaner may remove the pipes under a running server: its restart must not find itself in the way."""
    bin_dir = tmp_path / "bin"
    stand_in_first_on_path(bin_dir, monkeypatch)
    mps = CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True)
    assert mps is not None
    mps.start()
    shutil.rmtree(tmp_path / "mps" / "pipe")
    mps.stop()
    mps.start()
    assert mps.running
    other = CudaMps.for_mode("on", tmp_path / "mps", profile_asks=True)
    assert other is not None
    with pytest.raises(CudaMpsError, match="another running server"):
        other.start()
