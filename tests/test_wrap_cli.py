"""``python -m fsdp_ext.wrap`` and a smoke run of ``benchmarks/wrap.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.warm_helpers import forked_warm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PYTHON = [sys.executable]  # forked warm (the fixture below)


@pytest.fixture(autouse=True, scope="module")
def _cli_forked_warm(warm_server_socket):
    """The CLI and the benchmark run as forks of the session's warm server (fsdp_ext/warm):
    the same programs and messages, without torch's imports each."""
    with forked_warm(warm_server_socket, PYTHON):
        yield


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [*PYTHON, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cli_prints_plan_for_a_factory():
    out = _run(
        "-m",
        "fsdp_ext.wrap",
        "benchmarks.wrap_models:ModelWithFineGrainedBlock",
        "--threshold",
        "12100",
        "--param-dtype",
        "bfloat16",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith("-> threshold 12100")
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:-1]}
    assert rows == {
        "<root>": ["0", "15437", "0"],
        "coarse_grained_layer1": ["132096", "132096", "264192"],
        "coarse_grained_layer2": ["131200", "131200", "262400"],
        "fine_grained_layer": ["786432", "12098", "1572864"],
    }
    # The fine block's backward: its parameters and gradients, layer2 prefetched.
    assert f"estimated peak unsharded bytes: {2 * 1572864 + 262400}" in lines[-1]


def test_cli_rejects_bad_factory_and_budget():
    out = _run("-m", "fsdp_ext.wrap", "no_colon_here", timeout=120)
    assert out.returncode != 0 and "MODULE:FACTORY" in out.stderr
    out = _run(
        "-m",
        "fsdp_ext.wrap",
        "benchmarks.wrap_models:ModelWithFineGrainedBlock",
        "--budget",
        "10",
        timeout=120,
    )
    assert out.returncode != 0 and "memory_budget_bytes" in out.stderr


@pytest.mark.slow
def test_benchmark_smoke():
    out = _run(
        "benchmarks/wrap.py",
        "--quick",
        "--layers",
        "2",
        "--experts",
        "4",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--seq",
        "9",
        "--budget-layers",
        "2.5",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "wrap"
    assert set(result["policies"]) == {"leaf", "block", "granularity", "fsdp1_transformer"}
    leaf, block = result["policies"]["leaf"], result["policies"]["block"]
    # 2 layers x (4 attn + 2 norms + router + 4 experts x 3 + 3 shared + gate) + 3 + root.
    assert leaf["units"] == 2 * 23 + 3 + 1
    assert block["units"] == 3
    # A unit gathers in forward and again in backward, and reduce-scatters once; the root
    # stays unsharded after forward (one gather), and under leaf it holds no parameters.
    assert leaf["all_gathers_per_step"] == 2 * (leaf["units"] - 1)
    assert leaf["reduce_scatters_per_step"] == leaf["units"] - 1
    assert block["all_gathers_per_step"] == 2 * (block["units"] - 1) + 1
    assert block["reduce_scatters_per_step"] == block["units"]
    # Fused norms by default: every policy, leaf included, trains to the same bits.
    assert result["norm"] == "fused"
    assert result["losses_identical"] is True
    assert result["granularity_peak_within_budget"] is True
    # The budget sweep: per-block against our plan at 2.5 / 4.5 / 8.5 layers.
    sweep = result["budget_sweep"]
    assert [r["budget_layers"] for r in sweep["budgets"]] == [2.5, 4.5, 8.5]
    assert sweep["block"]["units"] == 3
    for row in sweep["budgets"]:
        assert row["losses_identical_to_block"] is True
        assert 0 < row["ours"]["measured_peak_bytes"] <= row["ours"]["est_peak_bytes"]
        assert row["peak_within_budget"] is True
    assert result["peak_within_budget_all"] is True
    assert result["step_ratio_best_budget_vs_block"] > 0


@pytest.mark.slow
def test_benchmark_hf_smoke():
    """``--hf``: ours against torch's own per-layer fully_shard, its keys and wire counts."""
    pytest.importorskip("transformers")
    args = ["--hf", "--hf-configs", "mixtral_tiny", "--hf-steps", "2", "--warmup", "1"]
    out = _run("benchmarks/wrap.py", *args, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    row = result["configs"]["mixtral_tiny"]
    assert row["losses_identical"] is True and row["same_collectives_as_same_plan"] is True
    ours, tutorial = row["default"], row["torch_per_layer"]
    assert ours["units"] == tutorial["units"] == ["<root>", "model.layers.0", "model.layers.1"]
    assert (ours["all_gathers_per_step"], tutorial["all_gathers_per_step"]) == (4, 5)
    for key in ("default_over_torch_per_layer", "default_over_torch_same_plan"):
        assert result[f"{key}_mixtral_tiny"] > 0 and f"{key}_max" in result


def test_train_script_defaults_to_granularity_wrap():
    import torch

    import fsdp_ext
    from examples.model import Block, ModelConfig, Transformer
    from examples.train import WRAP_POLICIES, parse_args

    assert parse_args([]).wrap == "granularity"
    assert parse_args(["--wrap", "block"]).wrap == "block"
    with torch.device("meta"):
        model = Transformer(ModelConfig())
    plan = fsdp_ext.plan_units(model, WRAP_POLICIES["granularity"])
    blocks = [n for n, m in model.named_modules() if isinstance(m, Block)]
    # One unit per Block; the embeddings, final norm and output layer stay in the root
    # (a unit of their own would cost more gathers than it saves without a memory budget).
    assert [u.fqn for u in plan.units] == ["", *blocks]
    assert plan.reshard_after_forward[-1] is False  # the last block: its backward is next
