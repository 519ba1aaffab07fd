"""FFmpeg in the gateway on one thread per call: the gateway runs responses side by side itself.

PyAV passes every frame it encodes through a libavfilter graph (its audio resampler, which also cuts
frames to the codec's size), and FFmpeg gives each graph a pool of one thread per CPU. So every mp3,
Opus or AAC response started as many threads as the host has CPUs and joined them at its end, while a
mono 24 kHz stream gives a filter nothing to split: 48 responses in one process held 722 threads with
16 CPUs counted, and starting and ending an encoder for 0.2 s of audio took 3.8-4.8 ms against
2.2-3.3 ms with one. Responses already run in parallel on the audio threads (:mod:`.audio_threads`).

PyAV has no handle on that graph, so FFmpeg is told the machine has one CPU (``av_cpu_force_count``,
libavutil's public call), which sets every automatic thread count of FFmpeg in this process to one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import av  # noqa: F401  # loads PyAV's libavutil, which loaded_library looks for

logger = logging.getLogger(__name__)

_LIBRARY = "libavutil"


@functools.cache
def single_threaded_ffmpeg() -> bool:
    """Make FFmpeg's automatic thread counts one in this process; False where its libavutil is not found."""
    path = loaded_library(_LIBRARY)
    if path is None:
        logger.debug("%s not found among the loaded libraries; FFmpeg keeps a thread per CPU", _LIBRARY)
        return False
    ctypes.CDLL(path).av_cpu_force_count(1)
    return True


def loaded_library(stem: str, maps: Path = Path("/proc/self/maps")) -> str | None:
    """The file of the shared library ``stem`` (``libavutil``) as this process mapped it, or None.

    The copy PyAV loaded, by its path: a wheel bundles FFmpeg under a name of its own
    (``libavutil-<hash>.so.60``), which ``ctypes.util.find_library`` does not look for, and another
    libavutil on the system would have its own CPU count.
    """
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith((f"{stem}-", f"{stem}.so")):
            return fields[5]
    return None
