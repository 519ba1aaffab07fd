"""Random-weight checkpoints in the real on-disk layout, for tests and benchmarks."""
