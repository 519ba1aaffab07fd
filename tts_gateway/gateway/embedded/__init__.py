"""Running Triton servers inside the gateway's process tree (the embedded default).

Owns starting one server from the ``nvidia-pytriton`` wheel, the fleet of servers across GPUs, the
supervisor that restarts a server that died, CUDA MPS and GPU discovery. It may import only the root
leaves and ``tts_gateway.models`` (rendering the model repository), never ``triton``, ``speech`` or
``api``: the gateway reaches an embedded server as any other, through ``triton``.
"""
