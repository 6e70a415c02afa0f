"""The main training job and its pieces; importable so tests and benchmarks can drive it."""
