"""An exclusive lock that the processes of one host take on a shared file, for as long as a ``with`` block runs."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the ``flock`` of ``path`` (created where missing, in a directory that exists); blocks until it is free.

    An ``flock`` belongs to the open file, so threads of one process exclude each other too, and a
    process that dies releases it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
