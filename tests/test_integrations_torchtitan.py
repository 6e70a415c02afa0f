"""fsdp_ext.integrations.torchtitan against torchtitan 0.3.0, 2 gloo ranks, CPU.

Models: torchtitan's Llama3 ``debugmodel`` (2 of its 6 blocks) and Qwen3 ``debugmodel_moe``
(2 blocks of the same shape, built with torchtitan's own layer builder, 8 experts of
hidden 128 top-2 instead of 64 of 768 top-8, to stay small). Both use torchtitan's
``ScaledDotProductAttention`` as the inner attention, swapped into the debug config exactly
as torchtitan's own tests do (``experiments/graph_trainer/common_utils.py``,
``build_decoder_config_for_backend``): 0.3.0's model registries refuse ``"sdpa"`` for
language models, and the flex attention they default to has no backward on CPU
("FlexAttention does not support backward on CPU", torch 2.13), so a CPU training test
cannot use it. Without per-document positions SDPA is plain causal attention.

The step is torchtitan's ``Trainer.train_step``: its ``ParallelDims`` meshes, its
``CrossEntropyLoss`` (sum) divided by the global valid-token count (FSDP's gradient
division is off), its ``clip_grad_norm_``, ``OptimizersContainer`` (``default_adamw``),
``LRSchedulersContainer``, MoE load-balancing hook and ``CheckpointManager``. Its
``ParallelDims`` builds meshes on its module-level ``device_type``, which falls back to
"cuda" without an accelerator; the test sets it to "cpu". Weights are
initialised (``init_weights``) before sharding, so both wraps start from the same values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_ext
from fsdp_ext.integrations import torchtitan as tt_fsdp  # imports torchtitan only when used
from fsdp_ext.testing import run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    # here rather than at import, so the default run (which deselects these) never pays
    # for importing torchtitan
    pytest.importorskip("torchtitan")


WORLD = 2
STEPS = 10
BATCH, SEQ = 2, 32


def _config(name: str, num_experts: int = 8):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if name == "llama3":
        from torchtitan.models.llama3 import model_registry

        config = model_registry("debugmodel").model
        config.layers = config.layers[:2]
    elif name == "qwen3":  # dense, tied embeddings: only planned, not trained
        from torchtitan.models.qwen3 import model_registry

        config = model_registry("debugmodel").model
        config.layers = config.layers[:2]
    else:
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry

        config = model_registry("debugmodel_moe").model
        config.layers = _build_qwen3_moe_layers(
            n_layers=2,
            dim=config.dim,
            n_heads=16,
            n_kv_heads=8,
            head_dim=128,
            moe_hidden_dim=128,
            num_experts=num_experts,
            top_k=min(2, num_experts),
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=128, max_seq_len=4096, theta=1000000.0),
        )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _model(name: str, device: str = "cpu", num_experts: int = 8, ep: int = 1):
    config = _config(name, num_experts)
    if ep > 1:  # what Qwen3Model.Config.update_from_config does for EP (its Decoder part
        # imports torchtitan.trainer, which needs torchdata)
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = config.build()
    if device != "meta":
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model


def _parallel_dims(ep: int = 1):
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    # torchtitan falls back to "cuda" when no accelerator is found (tools/utils.py)
    parallel_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")  # as the Trainer does from its config

    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=WORLD,
        cp=1,
        tp=1,
        pp=1,
        ep=ep,
        world_size=WORLD,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def _shard(model, wrap: str, dims, policy=None, loco=None, comm=None, **options):
    """torchtitan's FSDP step (``wrap="torchtitan"``) or the drop-in, same arguments.

    Gradient division off makes FSDP reduce with ``PREMUL_SUM(1.0)``, which gloo refuses
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); without LoCo, both wraps are told to
    reduce with ``SUM`` and divide by 1.0 afterwards instead, the same values. LoCo's
    reduce-scatter takes the ``PREMUL_SUM`` op itself and needs no such change.
    """
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    args = (model, dims.get_mesh("fsdp"))
    kwargs = {"param_dtype": torch.float32, "reduce_dtype": torch.float32, "pp_enabled": False}
    kwargs.update(options)
    if wrap == "torchtitan":
        apply_fsdp_to_decoder(*args, **kwargs)
        handle = None
    else:
        if loco is not None:
            comm = fsdp_ext.CommConfig(gradients=loco)
        handle = tt_fsdp.apply_fsdp(*args, **kwargs, auto_wrap_policy=policy, comm=comm)
    if comm is None or comm.gradients is None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return handle


def _units(model) -> list[tuple]:
    """Every FSDP unit: members, reshard-after-forward, dtypes, offload, divide factor,
    and each parameter's placement."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], {}
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            seen[id(state)][0].append(fqn)
            continue
        groups = state._fsdp_param_groups
        row = [
            [fqn],
            tuple(g._reshard_after_forward for g in groups),
            tuple((g.mp_policy.param_dtype, g.mp_policy.reduce_dtype) for g in groups),
            tuple(g.mp_policy.cast_forward_inputs for g in groups),
            tuple(type(g.offload_policy).__name__ for g in groups),
            tuple(g.gradient_divide_factor for g in groups),
            tuple(str(p.fsdp_placement) for g in groups for p in g.fsdp_params),
            tuple((g.mesh_info.mesh.mesh_dim_names, g.mesh_info.shard_mesh_size) for g in groups),
        ]
        seen[id(state)] = row
        out.append(row)
    return [("+".join(r[0]), *r[1:]) for r in out]


def _plan_units(plan) -> list[str]:
    return [u.fqn for u in plan.units]


def _actual_units(model) -> list[str]:
    return [fqn for fqn, *_ in _units(model)]


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class _Training:
    """torchtitan's optimizer, scheduler and MoE hook around a sharded model."""

    def __init__(self, model, dims):
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import (
            LRSchedulersContainer,
            default_adamw,
            register_moe_load_balancing_hook,
        )

        self.model, self.dims = model, dims
        self.optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
        register_moe_load_balancing_hook(self.optimizers, [model], dims)
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ).build(optimizers=self.optimizers, training_steps=2 * STEPS)
        self.loss_fn = CrossEntropyLoss.Config().build()

    def step(self, step: int) -> float:
        """One ``Trainer.train_step``; returns the global average loss."""
        from torchtitan.distributed import utils as dist_utils

        self.optimizers.zero_grad()
        inputs, labels = _batch(step)
        global_valid_tokens = dist_utils.dist_sum_tensor(
            (labels != -100).sum(), self.dims.get_mesh("batch")
        )
        pred = self.model(inputs)
        loss, _ = self.loss_fn(pred, labels, global_valid_tokens)
        loss.backward()
        dist_utils.clip_grad_norm_(
            list(self.model.parameters()), 1.0, foreach=True, ep_enabled=self.dims.ep_enabled
        )
        self.optimizers.step()
        self.lr_schedulers.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()


def _train(model, dims, steps: range) -> list[float]:
    training = _Training(model, dims)
    return [training.step(s) for s in steps]


# ---------------------------------------------------------------- unit plans (meta, cheap)


def _rank_unit_plans() -> dict:
    """torchtitan's units vs the drop-in's and its dry run, for every reshard policy."""
    dims = _parallel_dims()
    out = {}
    for name in ("llama3", "qwen3", "qwen3_moe"):
        for options in (
            {},
            {"reshard_after_forward_policy": "always"},
            {"reshard_after_forward_policy": "never"},
            {"pp_enabled": True},
            {"cpu_offload": True, "param_dtype": torch.bfloat16},
        ):
            ref, ours = _model(name, "meta"), _model(name, "meta")
            _shard(ref, "torchtitan", dims, **options)
            plan = tt_fsdp.plan_fsdp(
                ours,
                dims.get_mesh("fsdp"),
                **{"param_dtype": torch.float32, "reduce_dtype": torch.float32},
                pp_enabled=options.get("pp_enabled", False),
                **{k: v for k, v in options.items() if k not in ("pp_enabled", "param_dtype")},
            )
            _shard(ours, "ours", dims, **options)
            key = f"{name} {options}"
            out[key] = (_units(ref), _units(ours), _plan_units(plan))
    return out


def test_default_policy_makes_torchtitans_units_with_its_options():
    """Per-block default: every unit, its members, reshard setting, mixed precision,
    offload, divide factor (1.0) and placements equal torchtitan's, for the dense, the
    tied (Qwen3 dense: one embedding+norm+head unit) and the MoE model, under every
    reshard policy; ``plan_fsdp`` predicts the units."""
    results = run_distributed(_rank_unit_plans, WORLD)
    for rank_result in results:
        for key, (ref, ours, planned) in rank_result.items():
            assert ours == ref, key
            assert sorted(planned) == sorted(["", *(u[0] for u in ref if u[0])]), key
    first = results[0]
    llama = first["llama3 {}"][0]
    assert [u[0] for u in llama] == ["", "tok_embeddings", "layers.0", "layers.1", "norm+lm_head"]
    assert dict((u[0], u[1]) for u in llama)["norm+lm_head"] == (False,)
    assert dict((u[0], u[1]) for u in llama)["layers.0"] == (True,)
    tied = first["qwen3 {}"][0]
    assert "tok_embeddings+norm+lm_head" in [u[0] for u in tied]
    factors = [f for u in llama for f in u[5]]
    assert len(factors) == 4 and set(factors) == {1.0}  # the root holds no parameter


def _prefetches(model) -> dict[str, tuple[list[str], list[str]]]:
    from torch.distributed.fsdp import FSDPModule

    units = {n: m for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    names = {id(m._get_fsdp_state()): n for n, m in units.items()}
    return {
        n: (
            [names[id(s)] for s in m._get_fsdp_state()._states_to_forward_prefetch],
            [names[id(s)] for s in m._get_fsdp_state()._states_to_backward_prefetch],
        )
        for n, m in units.items()
    }


def _rank_expert_units() -> dict:
    """Experts: Shard(1) when there are fewer than the shard degree (one expert on 2
    ranks, planned on meta), and EP 2 (``model.parallelize``: experts split over ep, on
    the efsdp mesh for FSDP), trained with torchtitan's wrap, the drop-in, and the drop-in
    with attention and MoE as separate units."""
    from torchtitan.models.common.attention import GQAttention
    from torchtitan.models.common.moe import MoE

    out = {}
    dims = _parallel_dims()
    ref, ours = _model("qwen3_moe", "meta", 1), _model("qwen3_moe", "meta", 1)
    _shard(ref, "torchtitan", dims)
    _shard(ours, "ours", dims)
    out["shard1"] = (_units(ref), _units(ours))
    dims = _parallel_dims(ep=2)
    for key, wrap, policy in [
        ("torchtitan", "torchtitan", None),
        ("ours", "ours", None),
        ("split", "ours", {GQAttention, MoE}),
    ]:
        model = _model("qwen3_moe", ep=2)
        model.parallelize(dims)
        edp_mesh = dims.get_optional_mesh(["efsdp"])
        _shard(model, wrap, dims, policy=policy, ep_degree=2, edp_mesh=edp_mesh)
        out[key] = (_units(model), _prefetches(model), _train(model, dims, range(STEPS)))
    return out


def test_expert_placements_ep_meshes_and_prefetch_are_torchtitans():
    """Shard(1) experts and EP 2 (experts on their own mesh: two param groups per MoE
    block; explicit prefetch in both directions) as torchtitan sets them. EP 2 trains: 10
    losses bit-identical to torchtitan's wrap, also with attention and MoE as separate
    units (the per-parameter meshes combine with the policy's units)."""
    for r in run_distributed(_rank_expert_units, WORLD):
        ref, ours = r["shard1"]
        assert ours == ref
        assert "S(1)" in dict((u[0], u[6]) for u in ref)["layers.0"]
        (ref, ref_prefetch, ref_losses), (ours, prefetch, losses) = r["torchtitan"], r["ours"]
        assert ours == ref and prefetch == ref_prefetch and losses == ref_losses
        meshes = dict((u[0], u[7]) for u in ref)["layers.0"]
        assert meshes == ((("fsdp",), 2), (("efsdp",), 1))  # dp and edp param groups
        forward = {n: f for n, (f, _) in ref_prefetch.items()}
        assert forward["tok_embeddings"] == ["layers.0"] and forward["layers.0"] == ["layers.1"]
        split, split_prefetch, split_losses = r["split"]
        assert sorted(dict((u[0], u[7]) for u in split)["layers.0.moe"]) == sorted(meshes)
        forward = {n: f for n, (f, _) in split_prefetch.items()}
        assert forward["layers.0.attention"] == ["layers.0.moe"]
        assert split_losses == ref_losses


# ---------------------------------------------------------------- training, bitwise


def _rank_losses(name: str, budget: int) -> dict:
    dims = _parallel_dims()
    out = {}
    ref = _model(name)
    _shard(ref, "torchtitan", dims)
    out["torchtitan"] = _train(ref, dims, range(STEPS))
    ours = _model(name)
    _shard(ours, "ours", dims)
    out["ours"] = _train(ours, dims, range(STEPS))
    policy = fsdp_ext.GranularityPolicy(memory_budget_bytes=budget)
    budgeted = _model(name)
    plan = tt_fsdp.plan_fsdp(
        budgeted,
        dims.get_mesh("fsdp"),
        torch.float32,
        torch.float32,
        False,
        auto_wrap_policy=policy,
    )
    out["plan"] = str(plan)
    out["planned"] = _plan_units(plan)
    _shard(budgeted, "ours", dims, policy=policy)
    out["budget_units"] = _actual_units(budgeted)
    out["per_block_units"] = _actual_units(ours)
    out["budget"] = _train(budgeted, dims, range(STEPS))
    return out


@pytest.mark.parametrize(("name", "budget"), [("llama3", 6_000_000), ("qwen3_moe", 12_000_000)])
def test_drop_in_losses_equal_torchtitans_bitwise(name, budget):
    """10 steps: the drop-in with the per-block default gives torchtitan's losses bit for
    bit on both ranks. A memory budget gives another plan, the one ``plan_fsdp`` printed,
    and trains: on Llama3 its losses are torchtitan's bit for bit, on Qwen3-MoE (attention
    and MoE in separate units) they drift from step 2 by up to 5e-6 relative: rounding, see
    ``test_gradients_equal_a_single_process_reference``."""
    results = run_distributed(_rank_losses, WORLD, name, budget)
    for r in results:
        assert r["ours"] == r["torchtitan"], name
        assert all(torch.isfinite(torch.tensor(r["ours"])))
        assert r["ours"][-1] < r["ours"][0]
        assert r["budget_units"] and sorted(r["budget_units"]) == sorted(r["planned"])
        assert sorted(r["budget_units"]) != sorted(r["per_block_units"]), r["plan"]
        torch.testing.assert_close(r["budget"], r["torchtitan"], rtol=2e-5, atol=0)


def _full_grads(model, batches) -> dict[str, torch.Tensor]:
    """One backward of torchtitan's summed loss over ``batches``, divided by the global
    token count; every gradient gathered whole."""
    from torchtitan.components.loss import CrossEntropyLoss

    loss_fn = CrossEntropyLoss.Config().build()
    tokens = torch.tensor(BATCH * SEQ * WORLD)
    for inputs, labels in batches:
        loss, _ = loss_fn(model(inputs), labels, tokens)
        loss.backward()
    return {
        k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for k, p in model.named_parameters()
        if p.grad is not None
    }


def _rank_gradients(name: str, budget: int) -> dict:
    dims = _parallel_dims()
    out = {}
    for key, policy in (("per_block", None), ("budget", budget)):
        model = _model(name)
        if policy is not None:
            policy = fsdp_ext.GranularityPolicy(memory_budget_bytes=policy)
        _shard(model, "ours", dims, policy=policy)
        out[key] = _full_grads(model, [_batch(0)])
    # the single-process reference: both ranks' batches through the unsharded model
    batches = []
    for rank in range(WORLD):
        g = torch.Generator().manual_seed(rank)  # _batch(0) on that rank
        tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    out["reference"] = _full_grads(_model(name), batches)
    return out


@pytest.mark.parametrize(("name", "budget"), [("llama3", 6_000_000), ("qwen3_moe", 12_000_000)])
def test_gradients_equal_a_single_process_reference(name, budget):
    """One backward on 2 ranks against the unsharded model on both ranks' batches: the
    per-block drop-in gives every gradient bit for bit. The budget plan's autograd graph
    differs (other unit boundaries), so a sum may round differently, and the difference
    spreads to everything upstream: every element may differ by 1e-6 of its tensor's
    largest entry (measured: at most 2.8e-7 of it, in the embedding). torchtitan's grouped
    experts multiply in bf16, where such a difference can flip a rounding: up to 1 element in
    10^4 may differ by one bf16 step of the largest entry (2^-8 of it; measured: 2 elements
    of layer 0's ``w2``, 4.8e-7 of 3.5e-3, and 1 of ``w3``). A dropped, doubled or mis-scaled
    contribution moves a whole row or column by about the size of its entries."""
    results = run_distributed(_rank_gradients, WORLD, name, budget)
    for r in results:
        ref = r["reference"]
        assert r["per_block"].keys() == ref.keys() == r["budget"].keys() and ref
        for k, want in ref.items():
            assert torch.equal(r["per_block"][k], want), k
            diff = (r["budget"][k] - want).abs()
            largest = want.abs().max()
            assert diff.max() <= 2**-8 * largest, (k, diff.max())
            assert (diff > 1e-6 * largest).sum() <= want.numel() // 10_000, k


# ---------------------------------------------------------------- LoCo + checkpoint resume

SAVED_AT = 3


def _checkpointer(training: _Training, folder: str, exclude: tuple[str, ...] = ()):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=SAVED_AT,
        keep_latest_k=0,
        exclude_from_loading=list(exclude),
    )
    return config.build(
        dataloader=None,
        model_parts=[training.model],
        optimizers=training.optimizers,
        lr_schedulers=training.lr_schedulers,
        states={},
        sd_adapter=None,
        base_folder=folder,
    )


def _rank_loco_run(name: str, folder: str, resume: bool) -> dict:
    """LoCo 4-bit, torchtitan's CheckpointManager with the handle in its states: either
    ``2 * SAVED_AT`` steps saving at ``SAVED_AT``, or load that checkpoint (in this new
    process group) and run the remaining steps."""
    dims = _parallel_dims()
    model = _model(name)
    handle = _shard(model, "ours", dims, loco=fsdp_ext.LoCoConfig(bits=4, group_size=64))
    training = _Training(model, dims)
    checkpointer = _checkpointer(training, folder)
    tt_fsdp.with_comm_state(checkpointer, handle)
    out = {"losses": [], "error_bytes": None}
    first = SAVED_AT if resume else 0
    if resume:
        assert checkpointer.load(step=SAVED_AT)
        out["error_bytes"] = handle.state_dict()
    for step in range(first, 2 * SAVED_AT):
        out["losses"].append(training.step(step))
        checkpointer.save(curr_step=step + 1)
        if step + 1 == SAVED_AT:
            out["error_bytes"] = handle.state_dict()
    out["sent"] = handle.stats.bytes_sent
    out["loco_units"] = sorted(handle.header()["layout"])
    checkpointer.close()
    return out


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe"])
def test_loco_resume_through_torchtitans_checkpoint_manager_is_exact(name, tmp_path):
    """Train with LoCo on every unit, save model, optimizer, scheduler and LoCo's error
    buffers with torchtitan's CheckpointManager (DCP), load them in a new process group and
    go on: every rank gets its own buffers back, and the losses equal the uninterrupted
    run's bit for bit."""
    whole = run_distributed(_rank_loco_run, WORLD, name, str(tmp_path), False)
    resumed = run_distributed(_rank_loco_run, WORLD, name, str(tmp_path), True)
    for rank in range(WORLD):
        assert whole[rank]["sent"] > 0
        assert {"tok_embeddings", "layers.0", "layers.1", "norm+lm_head"} <= set(
            whole[rank]["loco_units"]
        )  # LoCo on every unit, torchtitan's [norm, lm_head] group included
        assert resumed[rank]["losses"] == whole[rank]["losses"][SAVED_AT:]
        assert list(resumed[rank]["error_bytes"]) == [f"rank{rank}"]
        assert resumed[rank]["error_bytes"] == whole[rank]["error_bytes"]


def _rank_without_loco_state(folder: str, phase: str) -> str:
    """Save without LoCo, then load with a LoCo handle in the states (``phase``: "plain"
    or "exclude", which excludes it from loading)."""
    from torch.distributed.checkpoint.api import CheckpointException

    dims = _parallel_dims()
    model = _model("llama3")
    loco = None if phase == "save" else fsdp_ext.LoCoConfig()
    handle = _shard(model, "ours", dims, loco=loco)
    training = _Training(model, dims)
    checkpointer = _checkpointer(training, folder, ("loco",) if phase == "exclude" else ())
    try:
        if phase == "save":
            training.step(0)
            checkpointer.save(curr_step=SAVED_AT)
            return "saved"
        tt_fsdp.with_comm_state(checkpointer, handle)
        try:
            checkpointer.load(step=SAVED_AT)
        except CheckpointException as exc:  # a BaseException, raised on every rank
            return f"{type(exc).__name__}: {exc.failures[dist.get_rank()][0]}"
        return "loaded"
    finally:
        checkpointer.close()


def test_a_checkpoint_without_loco_state_loads_with_exclude_from_loading(tmp_path):
    """A checkpoint from a run without LoCo lacks the handle's keys: DCP refuses it, and
    ``exclude_from_loading=["loco"]`` loads it (as docs/integrations.md says)."""
    assert run_distributed(_rank_without_loco_state, WORLD, str(tmp_path), "save") == ["saved"] * 2
    plain = run_distributed(_rank_without_loco_state, WORLD, str(tmp_path), "plain")
    assert plain == [
        f"CheckpointException: Missing key in checkpoint state_dict: loco.rank{r}."
        for r in range(WORLD)
    ]
    excluded = run_distributed(_rank_without_loco_state, WORLD, str(tmp_path), "exclude")
    assert excluded == ["loaded"] * 2


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "error", "named"),
    [
        ({"reshard_after_forward_policy": "sometimes"}, ValueError, "'always', 'never', 'default'"),
        ({"param_dtype": "bf16"}, TypeError, "param_dtype must be a torch.dtype"),
        ({"pp_enabled": 1}, TypeError, "pp_enabled must be a bool"),
        ({"ep_degree": 0}, ValueError, "ep_degree must be an int >= 1"),
        ({"ep_degree": 2}, ValueError, "needs edp_mesh"),
        ({"comm": "4bit"}, TypeError, "comm must be a fsdp_ext.CommConfig"),
        (
            {"comm": fsdp_ext.CommConfig(gradients="loco"), "ep_degree": 2},
            ValueError,
            "comm with ep_degree=2",
        ),
        (
            {
                "comm": fsdp_ext.CommConfig(hpz=True),
                "reshard_after_forward_policy": "never",
            },
            ValueError,
            "'never' keeps full copies: pick one",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sharded(change, error, named):
    from torch.distributed.fsdp import FSDPModule

    model = _model("llama3", "meta")
    kwargs = {"param_dtype": torch.float32, "reduce_dtype": torch.float32, "pp_enabled": False}
    with pytest.raises(error, match=named.replace("(", r"\(").replace("[", r"\[")):
        tt_fsdp.apply_fsdp(model, None, **{**kwargs, **change})
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    with pytest.raises(TypeError, match="model must be a torchtitan Decoder"):
        tt_fsdp.apply_fsdp(torch.nn.Linear(2, 2), None, **kwargs)


def test_with_comm_state_refuses_what_it_cannot_checkpoint():
    handle = fsdp_ext.CommHandle({}, fsdp_ext.LoCoConfig())
    checkpointer = type("Manager", (), {"states": {}})()
    with pytest.raises(TypeError, match="handle must be a CommHandle"):
        tt_fsdp.with_comm_state(checkpointer, object())
    with pytest.raises(ValueError, match="key must be a non-empty str other than"):
        tt_fsdp.with_comm_state(checkpointer, handle, key="optimizer")
    with pytest.raises(TypeError, match="enabled torchtitan CheckpointManager"):
        tt_fsdp.with_comm_state(object(), handle)
    tt_fsdp.with_comm_state(checkpointer, handle)
    assert checkpointer.states == {"loco": handle}


def _rank_spmd_types() -> dict:
    """0.3.0's default backend, the way its parallelize functions use it: the whole SPMD
    mesh and dp_mesh_dims (resolve_fsdp_mesh)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    parallel_dims.device_type = "cpu"
    set_spmd_backend("spmd_types")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=1, world_size=WORLD,
        spmd_backend="spmd_types",
    )  # fmt: skip
    dims.build_mesh()
    mesh, mesh_dims = resolve_fsdp_mesh(dims)
    kwargs = {"param_dtype": torch.float32, "reduce_dtype": torch.float32, "pp_enabled": False}
    out = {}
    for wrap, fn in (("torchtitan", apply_fsdp_to_decoder), ("ours", tt_fsdp.apply_fsdp)):
        model = _model("llama3")
        model.parallelize(dims)
        try:
            fn(model, mesh, **kwargs, dp_mesh_dims=mesh_dims)
            out[wrap] = "sharded"
        except ValueError as e:
            out[wrap] = str(e)
    set_spmd_backend("partial_dtensor")
    return out


def test_spmd_types_backend_is_refused_up_front_where_torchtitans_wrap_fails():
    for run in run_distributed(_rank_spmd_types, WORLD):
        assert "must be DTensors on the full SPMD mesh" in run["torchtitan"], run
        assert "choose spmd_backend='partial_dtensor'" in run["ours"], run
