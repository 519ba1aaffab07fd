"""Where the files shipped inside the package live (editable install and wheel alike); how user paths are read."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The model repository's sources: one directory per model (templates, model.py) and the profiles.
TRITON_REPOSITORY = PACKAGE_DIR / "triton_repo"
# The reference voices shipped with the gateway: NAME.wav + NAME.txt.
REFERENCE_VOICES = PACKAGE_DIR / "ref_audios"


def invocation_path(path: str | os.PathLike[str]) -> Path:
    """A path a user gave (an option, a setting), as the directory the command was started in reads it.

    Every command and setting resolves its paths through this once, where it reads them: the
    processes they reach run elsewhere (tritonserver runs in its work directory), where a relative
    path would name something else. Symbolic links are kept as given (a program keeps its name).
    """
    return Path(os.path.abspath(path))
