"""GPU tests: the CUDA runtime and ``train_step`` on a CUDA device, skipped where there is none; ``make gpu-check``
runs them."""
