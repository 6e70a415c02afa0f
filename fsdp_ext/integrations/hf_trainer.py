"""HF ``Trainer``: shard with an fsdp-ext policy, optionally with ZeRO++, under FSDP2.

The ``Trainer`` builds its own ``Accelerator`` from ``TrainingArguments(fsdp=True,
fsdp_config={"version": 2})`` and calls ``accelerator.prepare`` inside ``train()``, so a
user cannot call :func:`fsdp_ext.integrations.accelerate.prepare` in its place. Under FSDP2
the ``Trainer`` creates the optimizer right before that ``prepare``, from ``self.model``;
:class:`FSDPExtTrainer` shards the model there (``create_optimizer``, a documented override
point), so the optimizer is built over the sharded parameters and ``prepare`` takes the
model as it is; ``comm=CommConfig(...)`` turns ZeRO++ on there (``fsdp_ext.comm.enable``;
hpZ shards with the node's ranks). LoCo's error buffers are kept as with accelerate: every
rank writes its own file next to the optimizer state in each checkpoint and reads it back on
``resume_from_checkpoint`` (:mod:`fsdp_ext.integrations._common`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import Trainer

from fsdp_ext._torch import compiled_inner
from fsdp_ext.comm import CommConfig, CommHandle, enable
from fsdp_ext.integrations._common import (
    CPU_FSDP_DROPPED,
    LOCO_STATE_FILE,
    check_plugin,
    comm_from_arguments,
    load_comm_state,
    optimizer_param_names,
    refuse_sharded,
    restore_optimizer_params,
    save_comm_state,
    shard,
)

__all__ = ["LOCO_STATE_NAME", "FSDPExtTrainer"]

LOCO_STATE_NAME = LOCO_STATE_FILE  # the file each rank writes into a checkpoint

_WRAP_KEYS = ("auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params")


class FSDPExtTrainer(Trainer):
    """``Trainer`` whose FSDP2 units come from an fsdp-ext policy, with optional ZeRO++.

    ``auto_wrap_policy``: anything :func:`fsdp_ext.shard_by_policy` takes (default
    ``GranularityPolicy()``, one unit per block); the units are what
    ``fsdp_ext.plan_units(model, auto_wrap_policy)`` prints. The plugin's mesh, mixed
    precision, offload and ``reshard_after_forward`` apply as with accelerate's own wrap.
    ``comm``: ZeRO++ on every unit (``fsdp_ext.comm.enable``); ``self.comm_handle`` is the
    ``CommHandle`` once ``train()`` has sharded the model. Everything else is the stock
    ``Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        auto_wrap_policy: Any = None,
        comm: CommConfig | None = None,
        **kwargs: Any,
    ):
        self.auto_wrap_policy = auto_wrap_policy
        self.comm = comm_from_arguments(comm)
        self.comm_handle: CommHandle | None = None
        self._optimizer_param_names: list[list[str]] | None = None
        super().__init__(*args, **kwargs)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if not self.is_fsdp_enabled or getattr(plugin, "fsdp_version", 1) != 2:
            raise ValueError(self._why_no_fsdp2())
        check_plugin(plugin)
        refuse_sharded(self.model, "pass the unsharded model, FSDPExtTrainer shards it")
        ignored = [
            key
            for key in _WRAP_KEYS
            if self.args.fsdp_config.get(key) not in (None, 0)  # min_num_params defaults to 0
        ]
        if ignored:
            warnings.warn(
                f"FSDPExtTrainer ignores fsdp_config {ignored}: the FSDP units come from "
                f"auto_wrap_policy={auto_wrap_policy!r} (None means GranularityPolicy())",
                stacklevel=2,
            )

    def _why_no_fsdp2(self) -> str:
        kind = self.accelerator.distributed_type
        kind = str(getattr(kind, "value", kind))
        version = (self.args.fsdp_config or {}).get("version")
        asked = bool(self.args.fsdp) and str(version) == "2"
        if asked and kind == "MULTI_CPU":
            return (
                f"FSDPExtTrainer: {CPU_FSDP_DROPPED}; for the Trainer, call it in an override "
                "of create_accelerator_and_postprocess after super(), with "
                "FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args), and set "
                "self.is_fsdp_enabled = True"
            )
        if asked and kind == "NO":
            return (
                "FSDPExtTrainer needs a distributed launch (torchrun --nproc-per-node N): "
                "accelerate sees one process (distributed_type=NO)"
            )
        return (
            "FSDPExtTrainer needs FSDP2: TrainingArguments(fsdp=True, fsdp_config="
            f"{{'version': 2}}) (got fsdp={self.args.fsdp!r}, fsdp_config version "
            f"{version!r}, distributed_type={kind})"
        )

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Shard ``self.model`` first (once), so the optimizer holds the sharded parameters."""
        if not isinstance(compiled_inner(self.model), FSDPModule):
            # (a second train() sees the model torch.compile'd by the first one's prepare)
            shard(
                self.accelerator, self.model, auto_wrap_policy=self.auto_wrap_policy, comm=self.comm
            )
            if self.comm is not None:
                self.comm_handle = enable(self.model, self.comm)
        optimizer = super().create_optimizer(model)
        self._optimizer_param_names = optimizer_param_names(optimizer, self.model)
        return optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """The ``Trainer``'s first call after ``accelerator.prepare``: undo prepare's
        parameter re-mapping (see :func:`restore_optimizer_params`) before anything steps."""
        if self._optimizer_param_names is not None:
            restore_optimizer_params(self.optimizer, self.model, self._optimizer_param_names)
            self._optimizer_param_names = None
        return super().create_scheduler(num_training_steps, optimizer)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.comm_handle is not None:
            save_comm_state(self.comm_handle, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.comm_handle is not None:
            load_comm_state(self.comm_handle, checkpoint)
