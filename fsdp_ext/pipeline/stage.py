"""A ``PipelineStage`` whose FSDP gradient reduction is deferred or per microbatch.

Stock ``PipelineStage.backward_maybe_with_nosync`` turns off FSDP's gradient sync and
resharding for every microbatch, and ``perform_reduce_grad`` reduces once at the end:
one reduce-scatter per unit per step, but each unit's *unsharded* gradient lives from
the first microbatch's backward to the end of the step (ZeRO-1 memory for gradients).

``grad_sync="per_microbatch"`` reduce-scatters in every microbatch's backward instead,
so only the sharded gradient accumulates (ZeRO-2 under PP). Parameters are resharded
after each backward when the units reshard after forward (ZeRO-3), else kept unsharded
until the step ends (ZeRO-2). ``scale_grads`` still divides by the microbatch count once,
after the last microbatch: reduction is linear, so the gradients equal the deferred ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from fsdp_ext._torch import MetadataInferenceSeam, finalize_each_backward, fsdp_units

GRAD_SYNC_MODES = ("deferred", "per_microbatch")


class FSDPPipelineStage(MetadataInferenceSeam, PipelineStage):
    """``PipelineStage`` over an FSDP-sharded stage module, with a choice of ``grad_sync``."""

    def __init__(
        self,
        *args: Any,
        grad_sync: str = "deferred",
        reshard_after_backward: bool = False,
        n_microbatches: int | None = None,
        **kwargs: Any,
    ):
        if grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNC_MODES}, got {grad_sync!r}")
        super().__init__(*args, **kwargs)
        self.grad_sync = grad_sync
        self.reshard_after_backward = reshard_after_backward
        self.n_microbatches = n_microbatches  # of the schedule: pipeline_step checks batches
        self.comm_handle: Any = None  # set by build_pipeline when a comm is registered

    def _fsdp_root(self) -> FSDPModule | None:
        return self.submod if isinstance(self.submod, FSDPModule) else None

    def metadata_inference_context(self) -> contextlib.AbstractContextManager[None]:
        # torch >= 2.12 infers gradient shapes on the first step with an autograd pass
        # over the stage. FSDP would treat it as a real backward: units that reduce unused
        # parameters (MoE blocks) would send an extra reduce-scatter of zeros, moving LoCo's
        # error state. Nothing of it is a gradient, so nothing is reduced.
        root = self._fsdp_root()
        return contextlib.nullcontext() if root is None else _no_gradient_sync(root)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        root = self._fsdp_root()
        if self.grad_sync == "deferred" or root is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # Every microbatch is a complete FSDP backward: reduce-scatter, then wait for it.
        root.set_is_last_backward(True)
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(self.reshard_after_backward)
        finalize_each_backward(root)
        # Skip the FSDP branch of the parent: call the plain backward path.
        submod, self.submod = self.submod, _Plain(self.submod)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            self.submod = submod

    # V-shaped schedules (ZBVZeroBubble) hand gradients between two stages of one rank
    # after each backward action, also in ``schedule.eval``, where the backward itself is
    # skipped: torch (2.11-2.15) then asserts. Without a backward there is nothing to hand.
    def get_local_bwd_output(self, mb_index: int):
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if not self.has_backward:
            return None
        return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def perform_reduce_grad(self, grad_scale_factor: int):
        root = self._fsdp_root()
        if root is not None and not self.has_backward:
            # A forward-only step (``schedule.eval``) has no gradient to reduce, but the
            # stock stage runs FSDP's post-backward anyway: units that reduce unused
            # parameters (MoE blocks) would send zeros, moving LoCo's error state.
            _reshard(root)
            return None
        if self.grad_sync == "deferred" or root is None:
            return super().perform_reduce_grad(grad_scale_factor)
        self.start_gradient_reduction()
        self.wait_for_gradient_reduction(grad_scale_factor)

    # torch >= 2.15: multi-stage schedules reduce through these two instead of
    # ``perform_reduce_grad`` (earlier releases have neither and never call them).
    def start_gradient_reduction(self) -> None:
        root = self._fsdp_root()
        if self.grad_sync == "deferred" or root is None:
            return super().start_gradient_reduction()
        # Gradients were reduced microbatch by microbatch; parameters must be sharded
        # before the optimizer step (a schedule may not flag the last backward).
        _reshard(root)

    def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None:
        if self.grad_sync == "deferred" or self._fsdp_root() is None:
            return super().wait_for_gradient_reduction(grad_scale_factor)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


def _reshard(root: FSDPModule) -> None:
    for unit in fsdp_units(root):
        unit.modules[0].reshard()


class _Plain:
    """Stands in for the stage module inside the parent's backward: not an FSDPModule,
    so the parent takes its plain-backward branch; parameters come from the real one."""

    def __init__(self, module):
        self._module = module

    def parameters(self, *args, **kwargs):
        return self._module.parameters(*args, **kwargs)


@contextlib.contextmanager
def _no_gradient_sync(root: FSDPModule) -> Iterator[None]:
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
