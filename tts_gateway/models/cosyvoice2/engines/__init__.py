"""How the networks run fast: batching, CUDA graphs, compiled kernels, GPU sharing."""
