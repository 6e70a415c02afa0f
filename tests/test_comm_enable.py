"""``fsdp_ext.comm.enable(model, CommConfig(...))``: one call for ZeRO++, one handle back;
the configuration's checks; the deprecated names; and ZeRO++ under ``build_pipeline``.

The multi-rank checks run once, on 4 gloo ranks emulating 2 nodes of 2, and compare the
same training with and without ZeRO++ (a stock run, and for the pipeline the single-process
reference of tests/pipeline_cases.py).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext.comm import CommConfig, LoCoConfig, WeightQuantConfig, enable
from fsdp_ext.testing import run_distributed
from tests import pipeline_cases

ROOT = Path(__file__).resolve().parent.parent
WORLD, NODE = 4, 2
D, STEPS = 64, 4
GROUP = 32  # values per scale, for qwZ and LoCo alike

# ------------------------------------------------ the configuration


def test_comm_config_takes_short_names_and_configs():
    cfg = CommConfig(gradients="loco", weights="int8", secondary_shards="node")
    assert cfg.gradients == LoCoConfig() and cfg.weights == WeightQuantConfig()
    assert cfg.hpz and cfg.enabled
    assert CommConfig(gradients="q4").gradients == LoCoConfig(error_feedback=False)
    assert CommConfig(weights="int8_forward").weights == WeightQuantConfig(backward=False)
    own = LoCoConfig(bits=8, group_size=64)
    assert CommConfig(gradients=own).gradients is own
    assert not CommConfig().enabled and not CommConfig().hpz


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"gradients": "q8"}, "CommConfig.gradients", "['loco', 'q4'] or a LoCoConfig"),
        ({"gradients": WeightQuantConfig()}, "CommConfig.gradients", "LoCoConfig"),
        ({"weights": "int4"}, "CommConfig.weights", "['int8', 'int8_forward']"),
        ({"weights": LoCoConfig()}, "CommConfig.weights", "WeightQuantConfig"),
        ({"secondary_shards": "rack"}, "CommConfig.secondary_shards", "(None, 'node')"),
        ({"secondary_shards": True}, "CommConfig.secondary_shards", "(None, 'node')"),
        ({"node_size": 0}, "CommConfig.node_size", "'auto' or an int >= 1"),
        ({"node_size": True}, "CommConfig.node_size", "'auto' or an int >= 1"),
    ],
)
def test_a_bad_field_is_named_with_its_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError) as error:
        CommConfig(**kwargs)
    assert field in str(error.value) and allowed in str(error.value)


def test_enable_refuses_what_is_not_a_comm_config():
    with pytest.raises(TypeError, match="config must be a CommConfig, got LoCoConfig"):
        enable(nn.Linear(2, 2), LoCoConfig())


# ------------------------------------------------ deprecated names


@pytest.mark.parametrize("package", [fsdp_ext, fsdp_ext.comm], ids=["fsdp_ext", "comm"])
def test_the_old_config_name_warns_and_names_the_new_one(package):
    with pytest.warns(FutureWarning, match=r"QuantizedAllGather is deprecated.*WeightQuantConfig"):
        old = package.QuantizedAllGather
    assert old is WeightQuantConfig
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        package.NoSuchName  # noqa: B018  (only the renamed names resolve)


def test_the_old_name_in_a_from_import_warns():
    with pytest.warns(FutureWarning, match="use fsdp_ext.comm.WeightQuantConfig"):
        from fsdp_ext.comm import QuantizedAllGather  # noqa: F401


def test_the_adapters_old_loco_argument_warns_and_means_comm_gradients():
    from fsdp_ext.integrations._common import comm_from_arguments

    old = r"prepare\(loco=\.\.\.\) is deprecated.*use prepare\(comm=CommConfig\(gradients="
    with pytest.warns(FutureWarning, match=old):
        comm = comm_from_arguments(None, LoCoConfig(bits=8), "prepare")
    assert comm == CommConfig(gradients=LoCoConfig(bits=8))
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="not both"):
        comm_from_arguments(CommConfig(), LoCoConfig(), "prepare")
    with pytest.raises(TypeError, match=r"comm must be a fsdp_ext\.CommConfig or None"):
        comm_from_arguments(LoCoConfig(), None, "prepare")
    assert comm_from_arguments(CommConfig(), None, "prepare") is None  # nothing on: stock


OLD_NAMES = {"QuantizedAllGather"}
# keyword arguments that are deprecated on these calls
OLD_KEYWORDS = {
    "register_comm_hook": {"weights"},
    "prepare": {"loco"},
    "FSDPExtTrainer": {"loco"},
    "apply_fsdp": {"loco"},
}


def _deprecated_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = getattr(node, "id", None) or getattr(node, "attr", None)
        if isinstance(node, ast.alias):
            name = node.name
        if name in OLD_NAMES:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
        if isinstance(node, ast.Call):
            callee = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            for keyword in node.keywords:
                if keyword.arg in OLD_KEYWORDS.get(callee, ()):
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno}: {callee}({keyword.arg}=)"
                    )
    return found


def test_no_example_benchmark_or_script_uses_a_deprecated_name():
    files = [p for d in ("examples", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 10
    assert [use for path in files for use in _deprecated_uses(path)] == []


def test_the_checker_finds_each_kind_of_old_use(tmp_path):
    """The scan above can fail: each deprecated spelling in a file is found."""
    sample = ROOT / "examples" / "_deprecated_sample.py"
    sample.write_text(
        "import fsdp_ext\n"
        "from fsdp_ext import QuantizedAllGather\n"
        "w = fsdp_ext.QuantizedAllGather()\n"
        "fsdp_ext.register_comm_hook(m, c, weights=w)\n"
        "prepare(a, m, o, loco=c)\n"
        "FSDPExtTrainer(model=m, loco=c)\n"
        "apply_fsdp(m, mesh, loco=c)\n"
    )
    try:
        assert len(_deprecated_uses(sample)) == 6
    finally:
        sample.unlink()


def test_docs_name_the_old_config_only_as_deprecated():
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for line in path.read_text().splitlines():
            if "QuantizedAllGather" in line:
                assert "deprecated" in line, f"{path.name}: {line}"


# ------------------------------------------------ on 4 gloo ranks, 2 nodes of 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 16)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sharded(reshard):
    mesh = init_device_mesh("cpu", (WORLD,))
    net = Net()
    fsdp_ext.fully_shard(net, auto_wrap_policy={Block}, mesh=mesh, reshard_after_forward=reshard)
    return net


def _train(net) -> list[float]:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses


ZEROPP = CommConfig(
    gradients=LoCoConfig(group_size=GROUP),
    weights=WeightQuantConfig(group_size=GROUP),
    secondary_shards="node",
    node_size=NODE,
)


def _rank_enable() -> dict:
    hpz = fsdp_ext.node_local_reshard(mesh=None, intra_node_size=NODE, world_size=WORLD)
    out = {}
    net = _sharded(True)
    out["stock"] = _train(net)

    net = _sharded(hpz)
    handle = enable(net, ZEROPP)
    out["zeropp"] = _train(net)
    out["secondary"] = dict(handle.secondary_shards)
    out["grads"] = handle.stats
    out["weights"] = handle.weight_stats
    out["state_keys"] = sorted(handle.state_dict())

    # qwZ and hpZ alone: no gradient state, gradients as stock
    net = _sharded(hpz)
    handle = enable(net, CommConfig(weights="int8", secondary_shards="node", node_size=NODE))
    out["no_grad_state"] = handle.state_dict(), handle.gradient_config, handle.stats.bytes_sent

    # enable then remove: the stock run, bit for bit
    net = _sharded(True)
    enable(net, CommConfig(gradients="loco", weights="int8")).remove()
    out["removed"] = _train(net)

    # hpZ asked for, but the units reshard over both nodes: refused, naming the fix
    net = _sharded(True)
    with pytest.raises(ValueError) as error:
        enable(net, ZEROPP)
    out["off_error"] = str(error.value)
    with pytest.raises(ValueError) as error:
        enable(net, CommConfig(weights="int8"), replicate_group=dist.group.WORLD)
    out["replicate_error"] = str(error.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_ext.register_comm_hook(net, LoCoConfig(), weights=WeightQuantConfig()).remove()
    out["hook_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def _rank_pipeline(comm, n_microbatches: int = 4) -> dict:
    """tests/pipeline_cases.py's 1F1B run (pp 2 x the rest dp, SGD), with ``comm``."""
    world = dist.get_world_size()
    dims = fsdp_ext.ParallelDims(world, pp=2)
    dims.build_mesh("cpu")
    schedule, stages = fsdp_ext.build_pipeline(
        pipeline_cases.make_model(),
        dims,
        n_microbatches=n_microbatches,
        loss_fn=pipeline_cases.loss_fn,
        comm=comm,
    )
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=pipeline_cases.LR)
    dp_rank, local = dims.dp_flat_mesh.get_local_rank(), pipeline_cases.GLOBAL_BATCH // dims.dp
    losses = []
    for x, y in pipeline_cases.batches():
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        step = fsdp_ext.pipeline_step(schedule, stages, x[rows], y[rows])
        losses.append(fsdp_ext.reduce_pipeline_loss(step, stages, dims))
        opt.step()
        opt.zero_grad()
    handle = stages[0].comm_handle
    return {
        "losses": losses,
        "dp_ranks": dist.get_process_group_ranks(dims.dp_mesh.get_group()),
        "secondary": None if handle is None else dict(handle.secondary_shards),
        "grads": None if handle is None else handle.stats,
        "weights": None if handle is None else handle.weight_stats,
    }


def _rank_all() -> dict:
    return {
        "enable": _rank_enable(),
        "pipeline": _rank_pipeline(ZEROPP),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_rank_all, WORLD, timeout=300)


# int8 weights (one fp32 scale per 32 values) move a weight by at most absmax / 254 of its
# group, and 4-bit LoCo gradients keep an error of about 1/14 of a group's absmax that the
# feedback carries to the next step: over 4 AdamW steps of this net the losses stay within
# 1 % of the stock run (measured 0.3 %), and they differ from it (the wire was quantised).
LOSS_RTOL = 1e-2
# the pipeline run (SGD at lr 0.5, tests/pipeline_cases.py) against its reference: LoCo alone
# stays within 5e-3 there (tests/test_pipeline_dist.py); int8 weights add their own error
PIPELINE_LOSS_ATOL = 1e-2
INT8_RATIO = (GROUP + 4) / (GROUP * 4)  # codes + scale over fp32, per group
Q4_RATIO = (GROUP // 2 + 4) / (GROUP * 4)


def test_enable_turns_on_every_part_against_the_stock_run(ranks):
    for rank in ranks:
        run = rank["enable"]
        assert run["zeropp"] == pytest.approx(run["stock"], rel=LOSS_RTOL)
        assert run["zeropp"] != run["stock"]
        # qwZ: int8 payload on the wire, forward gathers over all 4 ranks
        w = run["weights"]
        assert w.quantized_gathers == 4 * STEPS  # root + 3 blocks, each step
        assert w.bytes_sent / w.bytes_uncompressed == pytest.approx(INT8_RATIO, rel=0.01)
        # hpZ: every unit's secondary group is its node's 2 ranks; backward gathers stay there
        assert run["secondary"] == {
            "<root>": NODE,
            "blocks.0": NODE,
            "blocks.1": NODE,
            "blocks.2": NODE,
        }
        assert w.intra_node_gathers == 4 * STEPS and w.intra_node_bytes > 0
        # LoCo: 4-bit payload for every unit's reduce-scatter
        g = run["grads"]
        assert g.reductions == 4 * STEPS
        assert g.bytes_sent / g.bytes_uncompressed == pytest.approx(Q4_RATIO, rel=0.01)
        assert run["state_keys"] == [f"rank{ranks.index(rank)}"]


def test_parts_off_stay_stock_and_remove_undoes_everything(ranks):
    for rank in ranks:
        run = rank["enable"]
        assert run["no_grad_state"] == ({}, None, 0)
        assert run["removed"] == run["stock"]  # bit for bit


def test_hpz_that_would_be_silently_off_is_refused(ranks):
    run = ranks[0]["enable"]
    assert "unit <root> keeps its post-forward copy on ranks [0, 1, 2, 3]" in run["off_error"]
    assert "reshard_after_forward='node'" in run["off_error"]
    assert "set CommConfig.gradients" in run["replicate_error"]
    assert len(run["hook_warnings"]) == 1
    assert "register_comm_hook(weights=...) is deprecated" in run["hook_warnings"][0]
    assert "fsdp_ext.comm.enable(model, CommConfig(" in run["hook_warnings"][0]


def test_zeropp_under_build_pipeline_against_the_reference(ranks):
    """pp 2 x dp 2, 1F1B, SGD: the single-process reference is the run without ZeRO++."""
    ref_losses, _ = pipeline_cases.reference(False, 2, 4)
    for rank in ranks:
        run = rank["pipeline"]
        assert run["losses"] == pytest.approx(ref_losses, abs=PIPELINE_LOSS_ATOL)
        assert run["losses"] != pytest.approx(ref_losses, abs=1e-6)
        w, g = run["weights"], run["grads"]
        assert w.quantized_gathers > 0
        assert w.bytes_sent / w.bytes_uncompressed == pytest.approx(INT8_RATIO, rel=0.01)
        assert g.reductions > 0
        assert g.bytes_sent / g.bytes_uncompressed == pytest.approx(Q4_RATIO, rel=0.05)
        # hpZ by hand: nodes of 2, so a dp group of ranks on one node keeps its post-forward
        # copy over the whole group (True); one split over two nodes would keep all (False)
        on_one_node = len({r // NODE for r in run["dp_ranks"]}) == 1
        assert set(run["secondary"].values()) == {on_one_node}
