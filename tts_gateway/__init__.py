"""tts-gateway: an OpenAI-compatible speech endpoint for CosyVoice2 on Triton."""

import os

# tts-gateway forks only to exec (tritonserver, its supervisor's restarts). gRPC's fork handlers
# restart its poller in such a child, which then dies on the descriptors Popen closes before
# exec (grpc/grpc#43055). They must be off before gRPC initialises, hence here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
