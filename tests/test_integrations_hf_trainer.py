"""fsdp_ext.integrations.hf_trainer against the real HF Trainer, 2 gloo ranks, tiny Qwen2-MoE.

How the FSDP2 path is forced on CPU: ``TrainingArguments(use_cpu=True, fsdp=True,
fsdp_config={"version": 2})`` makes the Trainer build a ``FullyShardedDataParallelPlugin``,
but accelerate's CPU state is ``MULTI_CPU`` (DDP) and drops the plugin. The test's
``Trainer`` subclass therefore overrides ``create_accelerator_and_postprocess``: after the
stock one has built the ``Accelerator``, it sets ``distributed_type = FSDP`` on the
``AcceleratorState`` and the ``PartialState`` (each ``AcceleratorState()`` re-copies the
latter), hands the state a plugin built from the same ``args.fsdp_plugin_args`` (the
Trainer's own was dropped with the DDP state), and sets the Trainer's ``is_fsdp_enabled``:
what accelerate and the Trainer set on GPUs.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import fsdp_ext
from fsdp_ext.testing import run_distributed
from tests.hf_models import set_launch_env, tiny_qwen2_moe_config

WORLD = 2
STEPS = 8
SAVE_AT = 4
BATCH = 2
LR = 3e-2
# above the smallest peak of unsharded params + grads (125 kB), below per-block's: units
# layers.0.mlp, layers.1.self_attn, layers.1.mlp, lm_head and the root, not one per block
BUDGET_BYTES = 150_000


def _default():
    return fsdp_ext.GranularityPolicy()


def _budget():
    return fsdp_ext.GranularityPolicy(memory_budget_bytes=BUDGET_BYTES)


def _comm():
    return fsdp_ext.CommConfig(gradients=fsdp_ext.LoCoConfig(bits=4, group_size=32))


def _qwen2_moe():
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(tiny_qwen2_moe_config())


class _Tokens(torch.utils.data.Dataset):
    """WORLD * BATCH * STEPS runs of successive tokens mod 64 (learnable: the loss falls);
    one epoch is STEPS optimizer steps."""

    def __len__(self) -> int:
        return WORLD * BATCH * STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (7 * i + torch.arange(12)) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def _force_fsdp2(accelerator, plugin) -> None:
    """See the module docstring: what accelerate sets on GPUs."""
    from fsdp_ext.integrations.accelerate import keep_fsdp_on_cpu

    keep_fsdp_on_cpu(accelerator, plugin)


def _trainer_class(stock: bool = False):
    """FSDPExtTrainer, or with ``stock`` the plain Trainer (accelerate's own FSDP2 wrap)."""
    from accelerate import FullyShardedDataParallelPlugin
    from transformers import Trainer

    from fsdp_ext.integrations.hf_trainer import FSDPExtTrainer

    class RecordingTrainer(Trainer if stock else FSDPExtTrainer):
        """FSDP2 forced on CPU; records each step's batch and loss, and LoCo's error state
        when step SAVE_AT + 1 begins (what checkpoint-SAVE_AT holds)."""

        steps: list[dict]
        loco_before: dict[int, dict]

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            _force_fsdp2(
                self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            )
            self.is_fsdp_enabled = True

        def training_step(self, model, inputs, num_items_in_batch=None):
            step = self.state.global_step
            if getattr(self, "comm_handle", None) is not None:
                self.loco_before[step] = self.comm_handle.state_dict()
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.steps.append(
                {
                    "global_step": step,
                    "input_ids": inputs["input_ids"].clone(),
                    "labels": inputs["labels"].clone(),
                    "num_items_in_batch": num_items_in_batch,
                    "loss": loss.item(),
                }
            )
            return loss

    return RecordingTrainer


def _args(output_dir: str, **overrides):
    from transformers import TrainingArguments

    settings = {
        "output_dir": output_dir,
        "use_cpu": True,
        "ddp_backend": "gloo",
        "fsdp": True,
        "fsdp_config": {"version": 2},
        "per_device_train_batch_size": BATCH,
        "max_steps": STEPS,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "save_strategy": "steps",
        "save_steps": SAVE_AT,
        "logging_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }
    return TrainingArguments(**{**settings, **overrides})


def _run_trainer(
    output_dir: str,
    resume: str | None = None,
    *,
    stock: bool = False,
    train_args: dict | None = None,
    **recipe,
) -> dict:
    """The budget policy with LoCo for STEPS steps, a checkpoint every SAVE_AT steps;
    ``recipe`` replaces ``auto_wrap_policy`` / ``comm``; ``stock`` runs the plain Trainer."""
    from torch.distributed.fsdp import FSDPModule

    set_launch_env(WORLD)
    recipe = {} if stock else {"auto_wrap_policy": _budget(), "comm": _comm(), **recipe}
    trainer = _trainer_class(stock)(
        model=_qwen2_moe(),
        args=_args(output_dir, **(train_args or {})),
        train_dataset=_Tokens(),
        **recipe,
    )
    trainer.steps, trainer.loco_before = [], {}
    trainer.train(resume_from_checkpoint=resume)
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    handle = getattr(trainer, "comm_handle", None)
    return {
        "steps": trainer.steps,
        "losses": [s["loss"] for s in trainer.steps],
        "units": sorted(n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)),
        "loco_before": trainer.loco_before,
        "sent": handle.stats.bytes_sent if handle is not None else 0,
        # accelerate's data_ptr re-mapping undone: one entry per parameter on every rank
        "optimizer_holds_each_param_once": sorted(map(id, held))
        == sorted(map(id, trainer.model.parameters())),
    }


def _adapter_losses(steps: list[dict], output_dir: str) -> list[float]:
    """The same batches through fsdp_ext.integrations.accelerate.prepare and a plain loop
    that does what the Trainer's step does: its loss scaling for a token count gathered
    over ranks, clipping to max_grad_norm, its optimizer, a constant learning rate."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    from fsdp_ext.integrations.accelerate import prepare

    args = _args(output_dir)  # before the reset: building them resets accelerate's state
    AcceleratorState._reset_state(reset_partial_state=True)
    set_launch_env(WORLD)
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    _force_fsdp2(accelerator, plugin)
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    model, optimizer, _ = prepare(
        accelerator,
        _qwen2_moe(),
        # the Trainer puts weight_decay in its param groups, not in these kwargs
        lambda params: optimizer_cls(params, weight_decay=args.weight_decay, **optimizer_kwargs),
        auto_wrap_policy=_budget(),
        comm=_comm(),
    )
    losses = []
    for step in steps:
        model.train()
        out = model(
            input_ids=step["input_ids"],
            labels=step["labels"],
            num_items_in_batch=step["num_items_in_batch"],
        )
        # average_tokens_across_devices (the default): the count is every rank's, and the
        # Trainer multiplies the loss by the number of ranks
        loss = out.loss * accelerator.num_processes
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses


def _warning_for_wrap_keys(output_dir: str) -> list[str]:
    import warnings

    from accelerate.state import AcceleratorState

    args = _args(output_dir)
    args.fsdp_config["transformer_layer_cls_to_wrap"] = ["Qwen2MoeDecoderLayer"]
    AcceleratorState._reset_state(reset_partial_state=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer_class()(model=_qwen2_moe(), args=args, train_dataset=_Tokens())
    return [str(w.message) for w in caught if "FSDPExtTrainer ignores" in str(w.message)]


def _per_block_and_stock(output_dir: str) -> dict:
    """The recipe with the per-block default and no LoCo, and the stock Trainer."""
    from accelerate.state import AcceleratorState

    out = {"planned": sorted(u.fqn for u in fsdp_ext.plan_units(_qwen2_moe(), _default()).units)}
    short = {"max_steps": 4, "save_strategy": "no"}
    per_block = {"auto_wrap_policy": None, "comm": None}
    for name, recipe in {"per_block": per_block, "stock": {}}.items():
        AcceleratorState._reset_state(reset_partial_state=True)
        out[name] = _run_trainer(
            f"{output_dir}/{name}", stock=name == "stock", train_args=short, **recipe
        )
    return out


def _uninterrupted(output_dir: str) -> dict:
    out = _run_trainer(output_dir)
    out["per_block_and_stock"] = _per_block_and_stock(output_dir + "/per_block")
    out["planned"] = sorted(u.fqn for u in fsdp_ext.plan_units(_qwen2_moe(), _budget()).units)
    out["plan_text"] = str(fsdp_ext.plan_units(_qwen2_moe(), _budget()))
    out["adapter"] = _adapter_losses(out["steps"], output_dir + "/adapter")
    out["wrap_key_warnings"] = _warning_for_wrap_keys(output_dir + "/warn")
    return out


def _resumed(output_dir: str) -> dict:
    """Resume from checkpoint-SAVE_AT; then, with this rank's LoCo file gone, one more step."""
    import logging

    from accelerate.state import AcceleratorState

    from fsdp_ext.integrations.hf_trainer import LOCO_STATE_NAME

    checkpoint = os.path.join(output_dir, f"checkpoint-{SAVE_AT}")
    out = _run_trainer(output_dir, resume=checkpoint)
    own_file = os.path.join(checkpoint, LOCO_STATE_NAME.format(rank=dist.get_rank()))
    out["own_file"] = os.path.isfile(own_file)
    dist.barrier()
    os.remove(own_file)
    AcceleratorState._reset_state(reset_partial_state=True)
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("fsdp_ext.comm").addHandler(handler)
    try:
        no_file = _run_trainer(
            output_dir + "/no_file",
            resume=checkpoint,
            train_args={"max_steps": SAVE_AT + 1, "save_strategy": "no"},
        )
    finally:
        logging.getLogger("fsdp_ext.comm").removeHandler(handler)
    out["no_file"] = {"warned": warned, "loco_before": no_file["loco_before"]}
    return out


def _errors(state: dict, rank: int) -> dict[str, torch.Tensor]:
    """The tensors in a CommHandle state_dict (error buffers, their scales, reduction
    counts), by path: {"unit/reduce_scatter/error": tensor, ...}."""
    units = torch.load(io.BytesIO(state[f"rank{rank}"]), weights_only=True)["units"]
    flat, pending = {}, list(units.items())
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending += [(f"{path}/{key}", inner) for key, inner in value.items()]
        elif isinstance(value, torch.Tensor):
            flat[path] = value
    return flat


@pytest.mark.slow  # two process trees (train + references, then resumes): ~20 s on 2 cores
def test_trainer_recipe_trains_like_the_adapter_and_resumes_with_loco_state(tmp_path):
    first = run_distributed(_uninterrupted, WORLD, str(tmp_path), timeout=300)
    resumed = run_distributed(_resumed, WORLD, str(tmp_path), timeout=300)
    for rank, (run, again) in enumerate(zip(first, resumed, strict=True)):
        steps, losses = run["steps"], run["losses"]
        assert len(steps) == STEPS and run["sent"] > 0
        # the budget policy's units are the dry run's, and not one per block
        assert run["units"] == sorted({"", *run["planned"]}), run["plan_text"]
        assert "model.layers.0" not in run["units"], run["plan_text"]
        assert run["optimizer_holds_each_param_once"]
        # per-block default, no LoCo: the dry run's units, and the stock Trainer's losses
        # (accelerate's own FSDP2 wrap, other units), bit for bit
        per_block, stock = (
            run["per_block_and_stock"]["per_block"],
            run["per_block_and_stock"]["stock"],
        )
        assert per_block["units"] == sorted({"", *run["per_block_and_stock"]["planned"]})
        assert {"model.layers.0", "model.layers.1"} <= set(per_block["units"])
        assert per_block["losses"] == stock["losses"], (per_block["losses"], stock["losses"])
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert losses[-1] < losses[0] - 0.3, losses
        # the Trainer recipe and the accelerate adapter: the same losses, bit for bit
        assert run["adapter"] == losses, (run["adapter"], losses)
        assert run["wrap_key_warnings"], "fsdp_config['transformer_layer_cls_to_wrap'] unwarned"

        # resume: this rank's own file, restored before the first resumed step
        assert again["own_file"]
        saved, restored = (
            _errors(run["loco_before"][SAVE_AT], rank),
            _errors(again["loco_before"][SAVE_AT], rank),
        )
        assert saved.keys() == restored.keys()
        assert sum(path.endswith("/error") for path in saved) >= 4, sorted(saved)
        for path, value in saved.items():
            assert torch.equal(restored[path], value), (rank, path)
        want = steps[SAVE_AT:]
        got = again["steps"]
        assert [s["global_step"] for s in got] == [s["global_step"] for s in want]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g["input_ids"], w["input_ids"])
        assert [s["loss"] for s in got] == [s["loss"] for s in want]
        # a checkpoint without this rank's LoCo file: one warning, fresh (zero) buffers
        no_file = again["no_file"]
        assert any("holds no LoCo state" in w for w in no_file["warned"]), no_file["warned"]
        fresh = _errors(no_file["loco_before"][SAVE_AT], rank)
        assert fresh.keys() == saved.keys()
        errors = [value for path, value in fresh.items() if path.endswith("/error")]
        assert errors and all(not value.any() for value in errors)


# ------------------------------------------------ default run: refusals, no processes


def test_our_policy_in_fsdp_config_is_refused_not_dropped(tmp_path):
    from transformers import TrainingArguments

    # transformers checks fsdp_config["auto_wrap_policy"] against its names when the
    # arguments are built; the policy belongs in FSDPExtTrainer(auto_wrap_policy=...)
    with pytest.raises(ValueError, match=r"auto_wrap_policy.*must be one of"):
        TrainingArguments(
            output_dir=str(tmp_path),
            use_cpu=True,
            fsdp=True,
            fsdp_config={"version": 2, "auto_wrap_policy": _budget()},
        )


def test_recipe_without_fsdp2_is_refused(tmp_path):
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from fsdp_ext.integrations.hf_trainer import FSDPExtTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    try:
        with pytest.raises(ValueError, match=r"FSDPExtTrainer needs FSDP2.*fsdp=True"):
            FSDPExtTrainer(model=_qwen2_moe(), args=args, auto_wrap_policy=_budget())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # no state for later tests


def _cpu_launch_message(output_dir: str) -> str:
    from accelerate.state import AcceleratorState

    from fsdp_ext.integrations.hf_trainer import FSDPExtTrainer

    set_launch_env(WORLD)
    try:
        FSDPExtTrainer(model=_qwen2_moe(), args=_args(output_dir), train_dataset=_Tokens())
    except ValueError as e:
        return str(e)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return "no error"


def test_recipe_on_a_cpu_launch_says_accelerate_dropped_fsdp(tmp_path):
    """Under a 2-rank launch on CPU accelerate runs DDP and drops the FSDP plugin: the
    message says that, not "needs a distributed launch", and how to keep FSDP2."""
    for message in run_distributed(_cpu_launch_message, WORLD, str(tmp_path), timeout=300):
        assert "accelerate dropped the FSDP plugin: on CPU it runs DDP" in message, message
        assert "create_accelerator_and_postprocess" in message
        assert "distributed launch" not in message
