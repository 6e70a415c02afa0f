import os

# The Triton interpreter must be chosen before triton is first imported; kernels then run
# on CPU tensors so tests can compare them with their torch references.
os.environ.setdefault("TRITON_INTERPRET", "1")
