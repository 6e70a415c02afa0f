"""A state dict copied into host buffers that are kept and reused from save to save.

An asynchronous save must not read tensors that the next training step changes, so it writes
a copy. Allocating that copy at every save costs as much as the copy itself and fragments
host memory; like DCP's ``DefaultStager``, :class:`StagingBuffers` allocates once (pinned on
CUDA, so the device-to-host copy can run at full speed) and copies into the same buffers at
every later save. A buffer is reused only once the write that read it has finished: the
caller waits for the previous save first (``Checkpointer`` does).

One allocation per tensor, not one block for all: a block is all fresh pages, while buffers
of a tensor's size can take memory the allocator's heap already holds from the training's
transients. Measured from outside (peak RSS growth over the state, ``checkpoint_stall.py``,
ours async alone, one run each, load 4.5-12): 0.98, 1.19 and 1.20 per tensor, 1.34, 1.40
and 1.53 with one block.

The DTensors that wrap the buffers are kept too, and handed out again while the source's
mesh, placements, shape and stride hold: ``DTensor.from_local`` and ``to_local`` cost about
0.2 ms per tensor, more than the copy of most of an FSDP state's tensors (measured: 156
DTensors, 29 ms of wrapping against 53 ms of copying 237.5 MB).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_ext._torch import dtensor_local_tensor

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """Host copies of a state dict's tensors, one buffer per tensor, reused while shapes and
    dtypes stay the same. ``nbytes``: the bytes held, which is what staging costs."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # the staged DTensor around each buffer, with that buffer (its local tensor is a view)
        self._wrapped: dict[str, tuple[torch.Tensor, DTensor]] = {}
        self._from_device = False  # a copy of this save came from the GPU (non-blocking)
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any, *, defer: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """A copy of ``state`` whose tensors live in this object's buffers (DTensors keep
        their mesh and placements); other values are deep-copied. Returns once every copy
        has landed (a device-to-host copy is synchronised), except those of the tensors
        ``defer`` picks: their buffers are ready, but their bytes are copied later, by
        :meth:`copy_deferred`, which must run before anything writes those tensors."""
        seen: set[str] = set()
        self._from_device = False
        self._deferred = []
        staged = self._stage(state, "", seen, defer)
        for key in set(self._buffers) - seen:  # a tensor that is gone frees its buffer
            del self._buffers[key]
            self._wrapped.pop(key, None)
        self._land()
        return staged

    def copy_deferred(self) -> None:
        """Copy the tensors :meth:`stage` deferred into their buffers (any thread)."""
        deferred, self._deferred = self._deferred, []
        for buffer, source in deferred:
            self._copy(buffer, source)
        self._land()

    def _land(self) -> None:
        if self._from_device:
            torch.cuda.synchronize()  # the non-blocking copies land before a thread reads them
            self._from_device = False

    def _copy(self, buffer: torch.Tensor, source: torch.Tensor) -> None:
        buffer.copy_(source.detach(), non_blocking=source.is_cuda)
        self._from_device |= source.is_cuda

    def _buffer(
        self,
        key: str,
        source: torch.Tensor,
        seen: set[str],
        defer: Callable[[torch.Tensor], bool] | None,
    ) -> torch.Tensor:
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
        if defer is not None and defer(source):
            self._deferred.append((buffer, source))
        else:
            self._copy(buffer, source)
        return buffer

    def _stage(
        self, value: Any, key: str, seen: set[str], defer: Callable[[torch.Tensor], bool] | None
    ) -> Any:
        if isinstance(value, DTensor):
            local = self._buffer(key, dtensor_local_tensor(value), seen, defer)
            buffer, wrapped = self._wrapped.get(key, (None, None))
            if (
                wrapped is None
                or buffer is not local  # a new buffer
                or wrapped.device_mesh is not value.device_mesh
                or wrapped.placements != value.placements
                or wrapped.shape != value.shape
                or wrapped.stride() != value.stride()
            ):
                wrapped = DTensor.from_local(
                    local,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
                self._wrapped[key] = (local, wrapped)
            return wrapped
        if isinstance(value, torch.Tensor):
            return self._buffer(key, value, seen, defer)
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}/{k}", seen, defer) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._stage(v, f"{key}/{i}", seen, defer) for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)
