"""Wrap planning without process groups: properties, DeepSpeed's cases, FSDP1 parity."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _construct_wrap_fn,
    _post_order_apply,
    _recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import fsdp_ext
from benchmarks.wrap_models import (
    Expert,
    FineMoE,
    FineMoEConfig,
    MLPBlock,
    ModelWithFineGrainedBlock,
)
from fsdp_ext.wrap.policy import select_units
from fsdp_ext.wrap.tree import CONTAINER_TYPES, module_infos

# ---------------------------------------------------------------- random module trees


class Node(nn.Module):
    """A custom module: children, optionally its own parameter, forward unused here."""

    def __init__(self, children: list[nn.Module], own_param: int):
        super().__init__()
        for i, child in enumerate(children):
            self.add_module(f"c{i}", child)
        if own_param:
            self.w = nn.Parameter(torch.zeros(own_param))


class NodeB(Node):
    pass


def _build(spec) -> nn.Module:
    kind, payload = spec
    if kind == "linear":
        fan_in, fan_out, bias = payload
        return nn.Linear(fan_in, fan_out, bias=bias)
    if kind == "act":
        return nn.GELU()
    if kind == "mha":
        return nn.MultiheadAttention(8, 2)
    children, own = payload
    built = [_build(c) for c in children]
    if kind == "list":
        return nn.ModuleList(built)
    if kind == "seq":
        return nn.Sequential(*built)
    if kind == "dict":
        return nn.ModuleDict({f"k{i}": m for i, m in enumerate(built)})
    return (NodeB if kind == "nodeb" else Node)(built, own)


_leaf = st.one_of(
    st.tuples(
        st.just("linear"),
        st.tuples(st.integers(1, 24), st.integers(1, 24), st.booleans()),
    ),
    st.just(("act", None)),
    st.just(("mha", None)),
)
_tree = st.recursive(
    _leaf,
    lambda kids: st.tuples(
        st.sampled_from(["node", "nodeb", "list", "seq", "dict"]),
        st.tuples(st.lists(kids, min_size=1, max_size=4), st.sampled_from([0, 0, 3, 50])),
    ),
    max_leaves=14,
)
# The root is always a custom module, as a model is.
_root = st.tuples(
    st.just("node"),
    st.tuples(st.lists(_tree, min_size=1, max_size=4), st.sampled_from([0, 5])),
)


def _model(spec, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return _build(spec)


def _owner_unit(param_fqn: str, unit_fqns: list[str]) -> str:
    """FSDP semantics: a parameter belongs to the deepest unit whose subtree holds it."""
    owners = [u for u in unit_fqns if u == "" or param_fqn.startswith(u + ".")]
    return max(owners, key=len)


_thresholds = st.one_of(st.integers(0, 40), st.integers(0, 3000))


@settings(max_examples=60, deadline=None)
@given(spec=_root, threshold=_thresholds)
def test_every_parameter_in_exactly_one_unit_and_no_container(spec, threshold):
    model = _model(spec)
    plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(threshold))
    fqns = [u.fqn for u in plan.units]
    assert fqns[0] == "" and len(set(fqns)) == len(fqns)
    modules = dict(model.named_modules())
    for fqn in fqns[1:]:
        assert not isinstance(modules[fqn], CONTAINER_TYPES)
        parts = fqn.split(".")
        ancestors = [modules[".".join(parts[:i])] for i in range(1, len(parts))]
        assert not any(isinstance(a, nn.MultiheadAttention) for a in ancestors)
        assert any(True for _ in modules[fqn].parameters())
    # Recount independently of the planner: each named parameter has one owner unit.
    counted = dict.fromkeys(fqns, 0)
    for name, param in model.named_parameters():
        counted[_owner_unit(name, fqns)] += param.numel()
    assert counted == {u.fqn: u.numel for u in plan.units}
    assert sum(u.numel for u in plan.units) == sum(p.numel() for p in model.parameters())


@settings(max_examples=40, deadline=None)
@given(spec=_root, threshold=_thresholds, bf16=st.booleans())
def test_meta_plan_equals_real_plan(spec, threshold, bf16):
    mp = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    policy = fsdp_ext.GranularityPolicy(threshold)
    real = fsdp_ext.plan_units(_model(spec), policy, mp_policy=mp)
    meta = fsdp_ext.plan_units(_model(spec, "meta"), policy, mp_policy=mp)
    assert real.units == meta.units
    assert real.unit_bytes == meta.unit_bytes
    assert real.peak_bytes == meta.peak_bytes
    assert str(real) == str(meta)


@settings(max_examples=60, deadline=None)
@given(spec=_root, t1=_thresholds, t2=_thresholds)
def test_larger_threshold_never_more_units(spec, t1, t2):
    low, high = sorted((t1, t2))
    model = _model(spec)
    n_low = len(fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(low)).units)
    n_high = len(fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(high)).units)
    assert n_high <= n_low


@settings(max_examples=30, deadline=None)
@given(spec=_root, budget_fraction=st.floats(0.05, 1.5))
def test_budget_picks_coarsest_fitting_threshold(spec, budget_fraction):
    model = _model(spec)
    total = sum(p.numel() * 4 for p in model.parameters())
    budget = max(1, int(total * budget_fraction))
    try:
        plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=budget))
    except ValueError as err:
        assert "memory_budget_bytes" in str(err)
        finest = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(0))
        assert finest.peak_bytes > budget or max(finest.unit_bytes) > budget
        return
    assert plan.peak_bytes <= budget
    # No coarser threshold (any module granularity above the chosen one) also fits.
    for info in module_infos(model).values():
        if info.granularity is not None and info.granularity > plan.threshold:
            coarser = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(info.granularity))
            assert coarser.peak_bytes > budget


@settings(max_examples=30, deadline=None)
@given(spec=_root, budget_fraction=st.floats(0.05, 1.5))
def test_budget_folds_units_into_the_root_only_within_the_budget(spec, budget_fraction):
    model = _model(spec)
    budget = max(1, int(sum(p.numel() * 4 for p in model.parameters()) * budget_fraction))
    try:
        plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=budget))
    except ValueError:
        return  # no plan fits: test_budget_picks_coarsest_fitting_threshold covers it
    # The finest threshold is one below the smallest granularity: -1 for a model of 0s.
    unfolded = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(max(plan.threshold, 0)))
    before = {u.fqn: u.numel for u in unfolded.units}
    kept = [u.fqn for u in plan.units]
    # Folding only removes units, and what it removes lands in the root.
    assert sorted(kept[1:] + plan.folded) == sorted(before)[1:]
    assert plan.units[0].numel == before[""] + sum(before[f] for f in plan.folded)
    assert {u.fqn: u.numel for u in plan.units[1:]} == {f: before[f] for f in kept[1:]}
    assert plan.peak_bytes <= budget
    assert (len(plan.folded) > 0) == (len(plan.units) < len(unfolded.units))


def test_budget_folds_the_small_leftovers_of_the_benchmark_model():
    """2.5 decoder layers of budget: the layers stay units, embeddings, final norm and output
    layer join the root (two all-gathers and a reduce-scatter fewer each)."""
    with torch.device("meta"):
        model = FineMoE(FineMoEConfig(n_layers=4))
    layer_bytes = sum(p.numel() * 4 for p in model.layers[0].parameters())
    policy = fsdp_ext.GranularityPolicy(memory_budget_bytes=int(2.5 * layer_bytes))
    plan = fsdp_ext.plan_units(model, policy)
    assert [u.fqn for u in plan.units] == ["", *(f"layers.{i}" for i in range(4))]
    assert plan.folded == ["embed_tokens", "norm", "lm_head"]
    assert "folded into the root within the budget: 3 (embed_tokens, norm, lm_head)" in str(plan)
    assert plan.peak_bytes == plan.unit_bytes[0] + 2 * layer_bytes


def _plan_with_a_unit_sharded_already() -> tuple[list[str], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = FineMoE(FineMoEConfig(n_layers=2, num_experts=4))
    torch_fully_shard(model.lm_head, mesh=init_device_mesh("cpu", (1,)))
    plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=10**9))
    return [u.fqn for u in plan.units], plan.folded


def test_units_sharded_already_are_never_folded():
    from tests.dist import run_distributed

    units, folded = run_distributed(_plan_with_a_unit_sharded_already, 1)[0]
    assert units == ["", "lm_head"] and folded == []


# ---------------------------------------------------------------- DeepSpeed's fixed cases


def test_deepspeed_model_granularities():
    model = ModelWithFineGrainedBlock(hidden_dim=128, num_block=16)
    infos = {info.fqn: info for info in module_infos(model).values()}
    assert infos[""].granularity == 15437
    assert infos["fine_grained_layer"].granularity == 12098
    assert {infos[f"fine_grained_layer.mlp_layers.{i}"].granularity for i in range(16)} == {12288}
    assert infos["fine_grained_layer.mlp_layers"].granularity is None  # a container


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [
        (
            100,
            ["", "coarse_grained_layer1", "coarse_grained_layer2"]
            + [
                f"fine_grained_layer.mlp_layers.{i}.{p}"
                for i in range(16)
                for p in ("gate_proj", "up_proj", "down_proj")
            ],
        ),
        (12100, ["", "coarse_grained_layer1", "coarse_grained_layer2", "fine_grained_layer"]),
        (10_000_000, [""]),
    ],
)
def test_deepspeed_model_units(threshold, expected):
    with torch.device("meta"):
        model = ModelWithFineGrainedBlock()
    plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(threshold))
    assert [u.fqn for u in plan.units] == expected
    assert plan.units[0].numel == (1049728 if threshold == 10_000_000 else 0)
    assert plan.units[0].granularity == 15437


def test_plan_table_and_peak():
    with torch.device("meta"):
        model = ModelWithFineGrainedBlock()
    mp = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(12100), mp_policy=mp)
    # bf16: layer1 264192 B, layer2 262400 B, fine block 1572864 B; worst adjacent pair.
    assert plan.unit_bytes == [0, 264192, 262400, 1572864]
    assert plan.peak_bytes == 262400 + 1572864
    text = str(plan)
    assert "fine_grained_layer" in text and "12098" in text and "1572864" in text
    assert f"estimated peak unsharded bytes: {plan.peak_bytes}" in text


def test_default_is_one_unit_per_repeated_block():
    with torch.device("meta"):
        model = FineMoE(FineMoEConfig(n_layers=3, num_experts=4))
    plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy())
    assert [u.fqn for u in plan.units] == [
        "",
        "embed_tokens",
        "layers.0",
        "layers.1",
        "layers.2",
        "norm",
        "lm_head",
    ]
    # Granularity is not monotone along the tree: FineGrainedBlock (12098) is finer than
    # its MLPBlocks (12288), yet the default still stops at the blocks, not above them.
    plan = fsdp_ext.plan_units(ModelWithFineGrainedBlock(), fsdp_ext.GranularityPolicy())
    assert plan.threshold == 12288
    assert [u.fqn for u in plan.units] == [
        "",
        "coarse_grained_layer1",
        "coarse_grained_layer2",
        *(f"fine_grained_layer.mlp_layers.{i}" for i in range(16)),
    ]
    # No containers: every indivisible module is a unit.
    plan = fsdp_ext.plan_units(MLPBlock(8), fsdp_ext.GranularityPolicy())
    assert [u.fqn for u in plan.units] == ["", "gate_proj", "up_proj", "down_proj"]


def test_moe_block_is_one_unit_even_below_its_granularity():
    with torch.device("meta"):
        model = FineMoE(FineMoEConfig(n_layers=2, num_experts=8))
    infos = {i.fqn: i for i in module_infos(model).values()}
    # Between the expert's and the MoE block's granularity: the block would be split.
    threshold = infos["layers.0.mlp.experts.0"].granularity
    assert threshold < infos["layers.0.mlp"].granularity
    units = [u.fqn for u in fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(threshold)).units]
    assert "layers.0.mlp" in units
    assert not any(u.startswith("layers.0.mlp.") for u in units)


def test_multihead_attention_never_split():
    model = nn.Sequential(nn.Linear(16, 16), nn.MultiheadAttention(16, 2), nn.Linear(16, 16))
    for threshold in (0, 10, 100000):
        units = [
            u.fqn for u in fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(threshold)).units
        ]
        assert not any(u.startswith("1.") for u in units)


def test_tied_parameters_stay_in_one_unit():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.body = nn.ModuleList([MLPBlock(16) for _ in range(2)])
            self.head = nn.Linear(16, 64, bias=False)
            self.head.weight = self.embed.weight

    plan = fsdp_ext.plan_units(Tied(), fsdp_ext.GranularityPolicy(0))
    fqns = [u.fqn for u in plan.units]
    assert "embed" not in fqns and "head" not in fqns
    assert plan.units[0].numel == 64 * 16


# ---------------------------------------------------------------- FSDP1 parity


def _fsdp1_units(model: nn.Module, policy) -> list[str]:
    """Names of the modules FSDP1's own wrapping code would wrap (root excluded)."""
    names = {m: n for n, m in model.named_modules()}
    wrapped: list[str] = []

    def record(module, **kwargs):
        wrapped.append(names[module])
        return module

    if isinstance(policy, (ModuleWrapPolicy, CustomPolicy)):
        targets = policy._run_policy(model, set(), {})
        _post_order_apply(model, _construct_wrap_fn(model, targets, record))
    else:
        _recursive_wrap(
            model,
            policy,
            wrapper_cls=record,
            ignored_modules=set(),
            ignored_params=set(),
            only_wrap_children=True,
        )
    return sorted(wrapped)


def _our_units(model: nn.Module, policy) -> list[str]:
    names = {m: n for n, m in model.named_modules()}
    return sorted(names[m] for m in select_units(model, policy))


def _fsdp1_policies(min_num_params: int):
    return [
        functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={NodeB, nn.Linear}),
        ModuleWrapPolicy({Node}),
        CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features % 2 == 0),
        CustomPolicy(lambda m: {"reshard_after_forward": False} if isinstance(m, NodeB) else False),
    ]


@settings(max_examples=40, deadline=None)
@given(spec=_root, min_num_params=st.integers(1, 800))
def test_fsdp1_policies_choose_fsdp1_units_on_random_trees(spec, min_num_params):
    for policy in _fsdp1_policies(min_num_params):
        assert _our_units(_model(spec), policy) == _fsdp1_units(_model(spec), policy)


@pytest.mark.parametrize("min_num_params", [1, 1000, 20000, 100000, 500000])
def test_fsdp1_policies_choose_fsdp1_units_on_models(min_num_params):
    factories = [
        ModelWithFineGrainedBlock,
        lambda: FineMoE(FineMoEConfig(n_layers=2, num_experts=4)),
        lambda: nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 4), nn.Linear(32, 8)),
    ]
    policies = [
        *_fsdp1_policies(min_num_params),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MLPBlock, Expert}),
        ModuleWrapPolicy({MLPBlock, Expert, nn.MultiheadAttention}),
    ]
    for factory in factories:
        for policy in policies:
            assert _our_units(factory(), policy) == _fsdp1_units(factory(), policy)


def test_class_set_and_callable_policies():
    model = ModelWithFineGrainedBlock(num_block=3)
    by_set = fsdp_ext.plan_units(model, {MLPBlock})
    by_callable = fsdp_ext.plan_units(model, lambda m: isinstance(m, MLPBlock))
    expected = ["", *(f"fine_grained_layer.mlp_layers.{i}" for i in range(3))]
    assert [u.fqn for u in by_set.units] == expected
    assert [u.fqn for u in by_callable.units] == expected
    assert [u.fqn for u in fsdp_ext.plan_units(model, None).units] == [""]


# ---------------------------------------------------------------- bad input


def test_negative_threshold_rejected():
    with pytest.raises(ValueError, match="threshold"):
        fsdp_ext.GranularityPolicy(-1)
    with pytest.raises(TypeError, match="threshold"):
        fsdp_ext.GranularityPolicy(1.5)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        fsdp_ext.GranularityPolicy(memory_budget_bytes=0)
    with pytest.raises(ValueError, match="threshold or memory_budget_bytes"):
        fsdp_ext.GranularityPolicy(10, memory_budget_bytes=10)


@pytest.mark.parametrize("bad", ["granularity", 3, {1, 2}, nn.Linear, set()])
def test_unknown_policy_type_rejected(bad):
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        fsdp_ext.plan_units(ModelWithFineGrainedBlock(num_block=1), bad)
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        fsdp_ext.fully_shard(ModelWithFineGrainedBlock(num_block=1), auto_wrap_policy=bad)


def test_budget_below_largest_leaf_rejected():
    with torch.device("meta"):
        model = ModelWithFineGrainedBlock()
    largest_leaf = (1024 * 128 + 1024) * 4  # coarse_grained_layer1, fp32
    with pytest.raises(ValueError, match=r"memory_budget_bytes.*coarse_grained_layer1"):
        fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=largest_leaf - 1))
    # Enough for the leaf but not for two adjacent leaves: still no plan, still named.
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=largest_leaf))
    plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=4_000_000))
    assert plan.peak_bytes <= 4_000_000 and plan.threshold == 12288


def test_fully_shard_refuses_units_it_cannot_run():
    """Checked before any collective: a clear ValueError instead of a DTensor error or hang."""
    cfg = FineMoEConfig(n_layers=1, num_experts=4, skip_idle_experts=True)
    with pytest.raises(ValueError, match=r"routed experts.*hangs"):
        fsdp_ext.fully_shard(FineMoE(cfg), auto_wrap_policy={Expert})
    mha = nn.Sequential(nn.MultiheadAttention(16, 2))
    with pytest.raises(ValueError, match="MultiheadAttention"):
        fsdp_ext.fully_shard(mha, auto_wrap_policy={nn.Linear})
    with pytest.raises(ValueError, match="no forward"):
        fsdp_ext.fully_shard(FineMoE(cfg), auto_wrap_policy={nn.ModuleList})
