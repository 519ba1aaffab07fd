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

# GPU images run Triton's Python backend on Python 3.12 (where the stub crashed when its own thread
# freed a Python object; 3.11 only raced silently). The orchestrator's LLM stream, its thread-heaviest
# part, is tested again under 3.12, in a light environment: what the orchestrator imports, no torch.
# REQUIRE_PY312=1 (CI) turns a missing python3.12 into a failure instead of a warning.
find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}
if python312=$(find_python312); then
    "$python312" -m venv .venv312
    .venv312/bin/python -m pip install --quiet --upgrade pip
    .venv312/bin/python -m pip install --quiet numpy==1.26.4 soxr onnxruntime nvidia-pytriton==0.7.0 \
        'tritonclient[grpc]' pytest pytest-asyncio
    # The stub's interpreter ignores PYTHONPATH: the project is installed, without its dependencies.
    .venv312/bin/python -m pip install --quiet --no-deps -e .
    .venv312/bin/python -m pytest -p no:cacheprovider tests/cosyvoice/test_llm_grpc.py
elif [ "${REQUIRE_PY312:-0}" = 1 ]; then
    echo "python3.12 not found (set PYTHON312): the Python 3.12 leg of the tests cannot run" >&2
    exit 1
else
    echo "WARNING: python3.12 not found; skipped the Python 3.12 run of test_llm_grpc.py" >&2
fi
