"""Custom kernels. Each ``<name>.py`` holds a Triton kernel beside its torch reference."""
