"""What ``torch.compile`` needs from a Triton model's process before it compiles anything."""

from __future__ import annotations

import codecs
import locale


def _utf8_locale() -> bool:
    return codecs.lookup(locale.getpreferredencoding(False)).name == "utf-8"


def read_text_as_utf8() -> None:
    """Make the process's text files UTF-8, as torch.compile's templates are.

    Triton's Python stub embeds the interpreter without taking the locale from the environment:
    ``LC_CTYPE`` stays "C", text files open as ASCII, and the first compile fails. This sets
    ``LC_CTYPE`` from the environment, or to C.UTF-8 where that is not UTF-8 either.
    """
    for name in ("", "C.UTF-8"):
        if _utf8_locale():
            return
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
    if not _utf8_locale():
        raise RuntimeError("torch.compile needs a UTF-8 locale; set LANG=C.UTF-8")


def compile_failed(what: str, backend: str, exc: Exception) -> RuntimeError:
    """The error to raise when compiling ``what`` (e.g. "the flow") with ``backend`` fails: it names the way out."""
    return RuntimeError(
        f"compiling {what} with {backend!r} failed ({type(exc).__name__}: {exc}); "
        "an empty compile_backend runs it uncompiled"
    )
