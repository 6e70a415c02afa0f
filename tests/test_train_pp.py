"""examples/train.py --pp 2 on 4 ranks (pp=2 x dp=2): MoE with ep=2 inside the stages,
LoCo, checkpoints; a resumed run continues with exactly the straight run's losses."""

from dataclasses import replace
from typing import ClassVar

import pytest
import torch
from torch.distributed import ProcessGroup

from examples.model import ModelConfig, Transformer
from examples.train import TrainConfig, parse_args, train
from fsdp_ext import plan_stages
from fsdp_ext.testing import run_distributed

TINY_PP = TrainConfig(
    steps=4,
    batch_size=8,
    seq_len=16,
    model=ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_seq_len=16,
        num_experts=4,
        moe_hidden_dim=16,
    ),
    ep=2,
    pp=2,
    microbatches=2,
    comm="loco",
    warmup_steps=1,
    val_batches=1,
    verbose=False,
)


def _straight_then_split(root: str, cfg: TrainConfig = TINY_PP) -> dict:
    """One process tree: the straight run, then the same run stopped and resumed."""
    straight = train(replace(cfg, out=f"{root}/a"))
    first = replace(cfg, stop_after=2, ckpt_every=2, out=f"{root}/b")
    train(first)
    tail = train(replace(first, stop_after=0, resume=True))
    return {"straight": straight, "tail": tail}


def test_pp2_moe_ep2_loco_resumes_exactly(tmp_path):
    results = run_distributed(_straight_then_split, 4, str(tmp_path))
    for r in results:
        s, t = r["straight"], r["tail"]
        assert t["start_step"] == 2
        assert t["losses"] == s["losses"][2:]  # bitwise
        assert s["val_loss"] == t["val_loss"]
    assert len({r["straight"]["losses"][-1] for r in results}) == 1  # the global loss everywhere
    assert results[0]["straight"]["comm_stats"]["bytes_sent"] > 0  # LoCo ran


# ZeRO++ under --pp: build_pipeline puts qwZ and hpZ on every stage's units.
PP_QWZ = replace(TINY_PP, ep=1, qwz=True, qwz_group_size=32)


def test_pp2_qwz_loco_resumes_exactly(tmp_path):
    """--pp 2 --qwz --comm loco on 4 ranks: the stages' weight gathers go int8, and a resume
    at step 2 gives the straight run's losses bit for bit (LoCo's error state and the
    stages' shards come back through the checkpoint)."""
    results = run_distributed(_straight_then_split, 4, str(tmp_path), PP_QWZ)
    for r in results:
        s, t = r["straight"], r["tail"]
        assert t["start_step"] == 2
        assert t["losses"] == s["losses"][2:]
        w = s["weight_stats"]
        assert w["quantized_gathers"] > 0, w
        assert 0 < w["bytes_sent"] < 0.3 * w["bytes_uncompressed"], w  # int8 + scales vs fp32


@pytest.mark.slow
def test_pp2_zeropp_on_two_nodes_of_two_per_stage(tmp_path):
    """--pp 2 --zeropp on 8 ranks, nodes of 2: each stage's dp group of 4 spans two nodes,
    so backward gathers stay inside the node (hpZ), forward ones go int8 over the group,
    and LoCo reduces hierarchically; the resume is bit-exact."""
    cfg = replace(PP_QWZ, zeropp=True, hpz=True, intra_node_size=2)
    results = run_distributed(_straight_then_split, 8, str(tmp_path), cfg, timeout=300)
    for r in results:
        s, t = r["straight"], r["tail"]
        assert t["losses"] == s["losses"][2:]
        w, g = s["weight_stats"], s["comm_stats"]
        assert w["quantized_gathers"] > 0 and w["intra_node_gathers"] > 0, w
        assert g["intra_node_bytes"] > 0, g


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--pp", "3"], "--pp"),
        (["--pp", "2", "--microbatches", "3"], "--microbatches"),
        (["--pp", "4", "--n-layers", "2"], "--n-layers"),
    ],
)
def test_pp_arguments_fail_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=4)
    assert needle in capsys.readouterr().err


class GlooBytes:
    """Bytes this rank hands to gloo per (collective, dtype), counted on the ProcessGroup
    itself, below torch.distributed and the library: a ring sends (n - 1) / n of its input.
    Keys use the newer method names; torch 2.11's ProcessGroup has the older ones."""

    NAMES: ClassVar[dict[str, str]] = {
        "reduce_scatter_single": "reduce_scatter_single",
        "_reduce_scatter_base": "reduce_scatter_single",
        "all_to_all_single": "all_to_all_single",
        "alltoall_base": "all_to_all_single",
    }

    def __init__(self):
        self.bytes: dict[tuple[str, str], int] = {}
        self._originals = {}

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(ProcessGroup, name):
                self._originals[name] = getattr(ProcessGroup, name)
                setattr(ProcessGroup, name, self._counted(name, self._originals[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(ProcessGroup, name, fn)

    def _counted(self, name, fn):
        def counted(group, output, input, *args, **kwargs):
            n = group.size()
            key = (self.NAMES[name], str(input.dtype).removeprefix("torch."))
            sent = input.numel() * input.element_size() * (n - 1) // n
            self.bytes[key] = self.bytes.get(key, 0) + sent
            return fn(group, output, input, *args, **kwargs)

        return counted


def _stage_grad_bytes(cfg: TrainConfig, stage: int, shards: int) -> int:
    """fp32 bytes of one stage's gradients, each padded on dim 0 to a multiple of `shards`
    (FSDP's reduce-scatter input); the stage's modules are the split's."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    plan = plan_stages(model, cfg.pp)
    total = 0
    for name, p in model.named_parameters():
        top = name.split(".")[0]
        in_stage = (
            (top in plan.first and stage == 0)
            or (top in plan.last and stage == cfg.pp - 1)
            or any(name.startswith(b + ".") for b in plan.block_fqns(stage))
        )
        if in_stage:
            rows = -(-p.shape[0] // shards) * shards
            total += rows * (p.numel() // p.shape[0]) * 4
    return total


def _reduction_bytes(root: str) -> dict:
    out = {}
    for k in (None, 2):
        cfg = replace(TINY_PP, ep=1, steps=2, intra_node_size=k, out=f"{root}/{k}")
        with GlooBytes() as wire:
            summary = train(cfg)
        out[k] = {"wire": wire.bytes, "intra_node_bytes": summary["comm_stats"]["intra_node_bytes"]}
    return out


def test_pp2_hierarchical_loco_reduces_inside_the_node(tmp_path):
    """--pp 2 --intra-node-size 2 on 4 ranks: each stage's dp pair sits on one node, so its
    gradients reduce in full precision (half of the padded stage each step), with no 4-bit
    traffic; without the flag they go 4-bit. Measured on gloo's ProcessGroup."""
    results = run_distributed(_reduction_bytes, 4, str(tmp_path))
    for rank, r in enumerate(results):
        flat, nodes = r[None]["wire"], r[2]["wire"]
        assert flat.get(("reduce_scatter_single", "float32"), 0) == 0
        assert flat[("all_to_all_single", "uint8")] > 0
        assert ("all_to_all_single", "uint8") not in nodes
        expected = 2 * _stage_grad_bytes(TINY_PP, stage=rank // 2, shards=2) // 2
        assert nodes[("reduce_scatter_single", "float32")] == expected
        assert r[2]["intra_node_bytes"] == expected  # the library's own count agrees
