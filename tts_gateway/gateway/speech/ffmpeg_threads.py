"""FFmpeg in the gateway on one thread per call: the gateway runs responses side by side itself.

PyAV passes every frame it encodes through a libavfilter graph (its audio resampler, which also cuts
frames to the codec's size), and FFmpeg gives each graph a pool of one thread per CPU. So every mp3,
Opus, AAC or FLAC response started about a thread per CPU and joined them at its end, while a
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

import av  # noqa: F401  # loads PyAV's libavutil, which loaded_libraries looks for

logger = logging.getLogger(__name__)

_LIBRARY = "libavutil"


@functools.cache
def single_threaded_ffmpeg() -> bool:
    """Make FFmpeg's automatic thread counts one in this process; False where no libavutil took it."""
    done = False
    for path in loaded_libraries(_LIBRARY):
        try:
            ctypes.CDLL(path).av_cpu_force_count(1)
        except (OSError, AttributeError) as exc:  # a library gone from its path, or one without the call
            logger.warning("%s: FFmpeg keeps a thread per CPU (%s)", path, exc)
            continue
        done = True
    if not done:
        logger.debug("no %s among the loaded libraries; FFmpeg keeps a thread per CPU", _LIBRARY)
    return done


def loaded_libraries(stem: str, maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The files of the shared library ``stem`` (``libavutil``) this process mapped, each once.

    Found by path, as loaded: a wheel bundles FFmpeg under a name of its own
    (``libavutil-<hash>.so.60``), which ``ctypes.util.find_library`` does not look for. Every copy
    loaded gets the call, PyAV's and any other library's; one replaced on disk since (`` (deleted)``)
    cannot be opened again and is left out.
    """
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5].endswith(" (deleted)"):
            continue
        path = fields[5]
        if Path(path).name.startswith((f"{stem}-", f"{stem}.so")) and path not in found:
            found.append(path)
    return found
