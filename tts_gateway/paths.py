"""Where the files shipped inside the package live, for an editable install and a wheel alike."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The model repository's sources: one directory per model (templates, model.py) and the profiles.
TRITON_REPOSITORY = PACKAGE_DIR / "triton_repo"
# The reference voices shipped with the gateway: NAME.wav + NAME.txt.
REFERENCE_VOICES = PACKAGE_DIR / "ref_audios"
