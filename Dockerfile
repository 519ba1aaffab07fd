# syntax=docker/dockerfile:1
#
# Two images from one file:
#   docker build --target triton  -t tts-gateway-triton .   # Triton + TensorRT-LLM + CosyVoice2 models
#   docker build --target gateway -t tts-gateway .          # the OpenAI-compatible HTTP gateway
# No model is downloaded at build time: the triton image prepares /models (download,
# verify, engine build) at its first start, idempotently, and reuses the volume after.

ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${TRITON_IMAGE} AS triton
# token2wav compiles the flow's U-Net levels at load (1.5-2 minutes more start-up on an H100);
# inductor's cache on the models volume makes later starts reuse the compiled kernels.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TORCHINDUCTOR_CACHE_DIR=/models/.cache/torchinductor
WORKDIR /opt/tts-gateway
COPY docker/triton-requirements.txt /tmp/triton-requirements.txt
RUN pip install -r /tmp/triton-requirements.txt
COPY pyproject.toml README.md ./
COPY tts_gateway ./tts_gateway
# The image's torch/transformers serve TensorRT-LLM; --no-deps keeps them (see the requirements file).
RUN pip install --no-deps .
VOLUME ["/models"]
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=3 \
    CMD curl -fsS http://localhost:8000/v2/health/ready || exit 1
ENTRYPOINT ["tts-models", "launch", "--models-root", "/models", "--repo", "/models/repository", "--prepare"]
CMD ["--profile", "gpu-trtllm"]

FROM ${PYTHON_IMAGE} AS gateway
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TTS_HOST=0.0.0.0 \
    TTS_PORT=8080
WORKDIR /opt/tts-gateway
COPY pyproject.toml README.md ./
COPY tts_gateway ./tts_gateway
RUN pip install .
RUN useradd --system --uid 10001 gateway && mkdir -p /data/voices && chown gateway /data/voices
USER gateway
ENV TTS_VOICES_DIR=/data/voices
EXPOSE 8080
CMD ["tts-gateway", "serve"]
