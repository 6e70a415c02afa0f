"""Counters for what makes a GPU step slow without a GPU to see it: kernel launches and
host syncs.

- :class:`KernelLaunches` counts Triton launches by wrapping the launcher itself
  (``JITFunction.run`` on a GPU, ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``),
  so it sees every ``kernel[grid](...)`` whatever the entry point.
- :class:`HostSyncs` records, while active, every call that makes the host wait for the
  device on a GPU: reading a value (``.item()``, ``.tolist()``, ``bool``/``int``/``float`` of
  a tensor, ``.numpy()``), ops whose output size depends on values (``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``), and
  ``torch.tensor``/``torch.as_tensor`` given a ``device`` (a copy from pageable host memory,
  synchronous on CUDA). It works on CPU tensors, where nothing really waits, so that a CPU
  test catches the call a GPU would stall on. Work inside a custom op (a kernel entry point)
  is the kernel's, and hidden; the kernel's launch is what counts.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from fsdp_ext._torch import TorchDispatchMode

__all__ = ["HostSyncs", "KernelLaunches"]

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
}
_FROM_HOST = {torch.tensor: "tensor(device=)", torch.as_tensor: "as_tensor(device=)"}
_DATA_DEPENDENT = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten.unique",
    "aten.is_nonzero",
    "aten.equal",
)


class _FunctionSide(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READS.get(func)
        if name is None and func in _FROM_HOST and kwargs.get("device") is not None:
            name = _FROM_HOST[func]
        if name is not None:
            self.owner._record(name)
        return func(*args, **kwargs)


class _DispatchSide(TorchDispatchMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith(_DATA_DEPENDENT) or (
            name == "aten.repeat_interleave" and (kwargs or {}).get("output_size") is None
        ):
            self.owner._record(name)
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """``with HostSyncs() as syncs: step()`` -> ``syncs.counts`` (name -> calls) and
    ``syncs.where`` (the first library frame of each)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.where: list[tuple[str, str]] = []
        self._stack = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _record(self, name: str) -> None:
        self.counts[name] += 1
        frames = [
            f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
            for f in traceback.extract_stack()[:-2]
            if "/fsdp_ext/" in f.filename
        ]
        frames = [f for f in frames if not f.startswith("testing/")]
        self.where.append((name, frames[-1] if frames else "<outside the library>"))

    def __enter__(self) -> HostSyncs:
        self._stack.enter_context(_FunctionSide(self))
        self._stack.enter_context(_DispatchSide(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class KernelLaunches:
    """``with KernelLaunches() as launches: ...`` -> ``launches.names``, one entry (the
    kernel's name) per Triton launch in this process."""

    def __init__(self):
        self.names: list[str] = []

    @property
    def counts(self) -> Counter[str]:
        return Counter(self.names)

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        from triton.runtime import interpreter, jit

        saved = []
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            original = cls.run

            def run(kernel, *args, _original=original, **kwargs):
                if not kwargs.get("warmup"):
                    self.names.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
                return _original(kernel, *args, **kwargs)

            saved.append((cls, original))
            cls.run = run
        try:
            yield
        finally:
            for cls, original in saved:
                cls.run = original

    def __enter__(self) -> KernelLaunches:
        self._cm = self._patched()
        self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._cm.__exit__(*exc)
