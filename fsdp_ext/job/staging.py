"""A state dict copied into one host block that is kept and reused from save to save.

An asynchronous save must not read tensors that the next training step changes, so it writes
a copy. Allocating that copy at every save costs as much as the copy itself and fragments
host memory; like DCP's ``DefaultStager``, :class:`StagingBuffers` allocates once (pinned on
CUDA, so the device-to-host copy can run at full speed) and copies into the same memory at
every later save. A buffer is reused only once the write that read it has finished: the
caller waits for the previous save first (``Checkpointer`` does).

The buffers are slices of one block, not one allocation each: one mapping beside the
allocator's heap (long-lived buffers then never sit between the training step's short-lived
tensors), one pinned allocation on CUDA, and one size to report. Each buffer is a tensor
whose storage is exactly its own bytes (``torch.frombuffer`` over its slice), so that
``torch.save`` and DCP's writers see an ordinary tensor, never a view of the whole block
(which they would write whole, or clone).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["StagingBuffers"]

_ALIGN = 64  # bytes: every buffer starts on a cache line, aligned for any dtype


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


class StagingBuffers:
    """Host copies of a state dict's tensors, in one block reused while every tensor's key,
    shape and dtype stay the same. ``nbytes``: the block's bytes, what staging costs."""

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None
        self._layout: list[tuple[str, torch.Size, torch.dtype]] = []
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return 0 if self._block is None else self._block.numel()

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this object's block (DTensors keep
        their mesh and placements); other values are deep-copied. Returns once every copy
        has landed (a device-to-host copy is synchronised)."""
        sources: dict[str, torch.Tensor] = {}
        _collect(state, "", sources)
        layout = [(key, t.shape, t.dtype) for key, t in sources.items()]
        if layout != self._layout:
            self._allocate(sources)
            self._layout = layout
        for key, source in sources.items():
            self._copy(key, source)
        if any(t.is_cuda for t in sources.values()):
            torch.cuda.synchronize()  # the write reads the block from another thread
        return self._stage(state, "")

    def _copy(self, key: str, source: torch.Tensor) -> None:
        self._buffers[key].copy_(source.detach(), non_blocking=source.is_cuda)

    def _allocate(self, sources: dict[str, torch.Tensor]) -> None:
        self._block, self._buffers = None, {}  # the old block goes before the new one comes
        offsets, total = {}, 0
        for key, t in sources.items():
            offsets[key] = total
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pin = torch.cuda.is_available() and any(t.is_cuda for t in sources.values())
        block = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
        raw = memoryview(block.numpy()) if total else memoryview(b"")
        for key, t in sources.items():
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                self._buffers[key] = torch.empty(t.shape, dtype=t.dtype)
                continue
            part = raw[offsets[key] : offsets[key] + nbytes]
            flat = torch.frombuffer(part, dtype=torch.uint8)
            self._buffers[key] = flat.view(t.dtype).view(t.shape)
        self._block = block

    def _stage(self, value: Any, key: str) -> Any:
        if isinstance(value, DTensor):
            return DTensor.from_local(
                self._buffers[key],
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._buffers[key]
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._stage(v, f"{key}/{i}") for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)


def _collect(value: Any, key: str, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``value`` (a DTensor's local shard) by its path, in walk order."""
    if isinstance(value, torch.Tensor):
        out[key] = _local(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _collect(v, f"{key}/{k}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _collect(v, f"{key}/{i}", out)
