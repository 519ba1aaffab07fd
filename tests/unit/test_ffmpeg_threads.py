"""FFmpeg's automatic thread counts set to one (ffmpeg_threads.py), checked on the real PyAV and libavutil."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tts_gateway.gateway.speech.ffmpeg_threads import loaded_libraries

_MAPS_LINE = "7f0000000000-7f0000001000 r-xp 00000000 08:01 1234{pad}{path}\n"


def _maps(tmp_path: Path, *paths: str) -> Path:
    maps = tmp_path / "maps"
    maps.write_text("".join(_MAPS_LINE.format(pad=" " * 20, path=path) for path in paths) + "7f1-7f2 rw-p 0 00:00 0\n")
    return maps


def test_every_copy_is_found_once_by_the_name_a_wheel_or_the_system_gives_it(tmp_path: Path) -> None:
    bundled = "/site/av.libs/libavutil-5809ad29.so.60.26.102"
    system = "/usr/lib/x86_64-linux-gnu/libavutil.so.59.39.100"
    maps = _maps(tmp_path, "/usr/lib/libavcodec.so.61", bundled, bundled, system)
    assert loaded_libraries("libavutil", maps) == [bundled, system]


def test_unrelated_deleted_and_absent_give_none(tmp_path: Path) -> None:
    maps = _maps(tmp_path, "/usr/lib/libavutilities.so.1", "/usr/lib/libc.so.6", "/old/libavutil.so.59 (deleted)")
    assert loaded_libraries("libavutil", maps) == []
    assert loaded_libraries("libavutil", tmp_path / "absent") == []


# In a process of its own: the setting is for the whole process, and the test needs the count before it.
_ENCODE_THREADS = textwrap.dedent(
    """
    import os
    import numpy as np
    from tts_gateway.gateway.speech.audio_encoding import create_encoder
    from tts_gateway.gateway.speech.ffmpeg_threads import single_threaded_ffmpeg

    def started_by(fmt):
        before = len(os.listdir("/proc/self/task"))
        encoder = create_encoder(fmt, 24000)
        data = encoder.encode(np.zeros(4800, dtype=np.float32))
        during = len(os.listdir("/proc/self/task"))
        data += encoder.finish()
        assert data
        return during - before

    print([started_by(fmt) for fmt in ("mp3", "opus", "aac")])
    assert single_threaded_ffmpeg()
    print([started_by(fmt) for fmt in ("mp3", "opus", "aac")])
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_an_encoder_starts_no_threads_once_ffmpeg_is_single_threaded() -> None:
    lines = subprocess.run(
        [sys.executable, "-c", _ENCODE_THREADS], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    default, single = (json.loads(line) for line in lines)
    if len(os.sched_getaffinity(0)) > 1:
        assert min(default) >= 1, "FFmpeg started no threads to begin with: nothing is tested"
    assert single == [0, 0, 0]
