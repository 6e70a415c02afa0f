"""Which implementation a kernel entry point runs: Triton, the fast CPU path, or the reference.

Each kernel has a torch reference (the spec) and a Triton kernel; the codec kernels also have
a fast CPU path (plain torch, block by block in cache, bit-exact with the reference). By
default (``"auto"``) a CUDA tensor goes to the Triton kernel and anything else to the fast CPU
path where the kernel has one, else to the reference. Tests and debugging want the Triton
kernels on the real data path on CPU, through Triton's interpreter, or the reference itself,
so the choice can be forced:

- the environment variable ``TRITON_KERNELS_BACKEND`` = ``auto`` | ``triton`` | ``cpu`` |
  ``reference``, read at each call (so a ``torchrun`` child inherits it);
- the context manager :func:`use_backend`, which overrides the variable in this process.

``"cpu"`` runs the fast CPU path (on any device) where a kernel has one, else the reference.

``"triton"`` on a CPU tensor needs ``TRITON_INTERPRET=1`` set *before* ``triton`` is first
imported; without it the call raises instead of silently running the reference.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "cpu", "reference")
ENV_VAR = "TRITON_KERNELS_BACKEND"

_forced: list[str] = []


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def current_backend() -> str:
    """The innermost :func:`use_backend`, else ``$TRITON_KERNELS_BACKEND``, else ``"auto"``."""
    if _forced:
        return _forced[-1]
    return _check(os.environ.get(ENV_VAR, "auto") or "auto", ENV_VAR)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the kernel entry points with ``name`` (``auto``, ``triton``, ``cpu``, ``reference``)."""
    _forced.append(_check(name, "backend"))
    try:
        yield
    finally:
        _forced.pop()


def interpreter_active() -> bool:
    """Whether ``@triton.jit`` kernels here run in Triton's CPU interpreter."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


def implementation(t: torch.Tensor, *, cpu_path: bool = False) -> str:
    """``"triton"``, ``"cpu"`` or ``"reference"``: what an entry point called on ``t`` runs.

    ``cpu_path`` says whether the kernel has a fast CPU path.
    """
    backend = current_backend()
    fallback = "cpu" if cpu_path else "reference"
    if backend == "reference":
        return "reference"
    if backend == "cpu":
        return fallback
    if backend == "auto":
        return "triton" if t.is_cuda else fallback
    if not t.is_cuda and not interpreter_active():
        raise RuntimeError(
            f"{ENV_VAR}=triton on a {t.device.type} tensor needs TRITON_INTERPRET=1 set "
            "before triton is imported"
        )
    return "triton"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the entry point called on ``t`` should launch the Triton kernel."""
    return implementation(t) == "triton"
