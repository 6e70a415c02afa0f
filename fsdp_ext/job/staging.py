"""A state dict copied into host buffers that are kept and reused from save to save.

An asynchronous save must not read tensors that the next training step changes, so it writes
a copy. Allocating that copy at every save costs as much as the copy itself and fragments
host memory; like DCP's ``DefaultStager``, :class:`StagingBuffers` allocates once (pinned on
CUDA, so the device-to-host copy can run at full speed) and copies into the same buffers at
every later save. A buffer is reused only once the write that read it has finished: the
caller waits for the previous save first (``Checkpointer`` does).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """Host copies of a state dict's tensors, one buffer per tensor, reused while shapes and
    dtypes stay the same. ``nbytes``: the bytes held, which is what staging costs."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this object's buffers (DTensors keep
        their mesh and placements); other values are deep-copied."""
        seen: set[str] = set()
        staged = self._stage(state, "", seen)
        for key in set(self._buffers) - seen:  # a tensor that is gone frees its buffer
            del self._buffers[key]
        return staged

    def _buffer(self, key: str, source: torch.Tensor, seen: set[str]) -> torch.Tensor:
        seen.add(key)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(
                source.shape,
                dtype=source.dtype,
                device="cpu",
                pin_memory=source.is_cuda and torch.cuda.is_available(),
            )
            self._buffers[key] = buffer
        buffer.copy_(source.detach(), non_blocking=source.is_cuda)
        return buffer

    def _stage(self, value: Any, key: str, seen: set[str]) -> Any:
        if isinstance(value, DTensor):
            local = self._buffer(key, value.to_local(), seen)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._buffer(key, value, seen)
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}/{k}", seen) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._stage(v, f"{key}/{i}", seen) for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)
