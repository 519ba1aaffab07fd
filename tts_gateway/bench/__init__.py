"""What the package ships only so that benchmarks can measure it: the benchmark fixture model's tone.

The ``bench`` profile deploys ``triton_repo/bench_fixture`` next to Piper, and its ``model.py`` imports
:mod:`tts_gateway.bench.fixture`; it lives in the package, not in ``benchmarks/``, because Triton's
Python backend imports models from the installed package only. No voice and nothing in the gateway imports it.
"""
