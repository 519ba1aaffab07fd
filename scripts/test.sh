#!/usr/bin/env bash
# The project's one test command (README and CI): install everything, lint, type-check, test.
# Idempotent: reuses .venv and the parity reference code when they are already there.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The cosyvoice extra pins torch==2.13.0. Which build pip takes depends on its indexes: set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where only the CUDA build would be found.
python -m pip install --quiet -e '.[test,cosyvoice]'
# Upstream code, only as the reference for numerical parity tests (never imported by the product):
# CosyVoice (flow, HiFT, Matcha mel) and s3tokenizer (Whisper log-mel, mel filters).
if [ ! -d var/reference/cosyvoice ] || [ ! -d var/reference/s3tokenizer ]; then
    python -m pip install --quiet --no-deps --target var/reference cosyvoice-minicpmo==0.1.0 s3tokenizer==0.3.0
fi

ruff check .
ruff format --check .
mypy
pytest "$@"
