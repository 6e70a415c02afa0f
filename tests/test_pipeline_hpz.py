"""hpZ under ``build_pipeline`` where it does something: 8 ranks as pp 2 x dp 4 on nodes of
2, so each stage's dp group spans two nodes and the post-forward copies stay in the node.

FSDP builds a post-forward mesh for every unit with an int ``reshard_after_forward``, and
each build is a rendezvous of the whole world; the stages hold different units, so the
stages' ranks made different numbers of those calls and the job hung in ``build_pipeline``.
It now builds every stage's mesh in one call first.
"""

import torch
import torch.distributed as dist

import fsdp_ext
from fsdp_ext.comm import CommConfig, WeightQuantConfig
from fsdp_ext.testing import run_distributed
from tests import pipeline_cases

WORLD, PP, NODE, MICROBATCHES = 8, 2, 2, 2


def _train(comm) -> dict:
    dims = fsdp_ext.ParallelDims(dist.get_world_size(), pp=PP)
    dims.build_mesh("cpu")
    schedule, stages = fsdp_ext.build_pipeline(
        pipeline_cases.make_model(),
        dims,
        n_microbatches=MICROBATCHES,
        loss_fn=pipeline_cases.loss_fn,
        comm=comm,
    )
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
    dp_rank, rows = dims.dp_flat_mesh.get_local_rank(), pipeline_cases.GLOBAL_BATCH // dims.dp
    losses = []
    for x, y in pipeline_cases.batches(3):
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        step = fsdp_ext.pipeline_step(schedule, stages, x[mine], y[mine])
        losses.append(fsdp_ext.reduce_pipeline_loss(step, stages, dims))
        opt.step()
        opt.zero_grad()
    handle = stages[0].comm_handle
    return {
        "losses": losses,
        "dp_ranks": dist.get_process_group_ranks(dims.dp_mesh.get_group()),
        "secondary": None if handle is None else dict(handle.secondary_shards),
        "weights": None if handle is None else handle.weight_stats,
    }


def _both() -> dict:
    zeropp_weights = CommConfig(
        weights=WeightQuantConfig(group_size=32), secondary_shards="node", node_size=NODE
    )
    return {"stock": _train(None), "hpz": _train(zeropp_weights)}


def test_hpz_on_stages_that_span_nodes():
    results = run_distributed(_both, WORLD, timeout=240)
    for r in results:
        assert len(r["hpz"]["dp_ranks"]) == 4  # two nodes of 2 in each stage's dp group
        # every unit of the stage keeps its post-forward copy on its node's 2 ranks
        assert set(r["hpz"]["secondary"].values()) == {NODE}
        w = r["hpz"]["weights"]
        assert w.intra_node_gathers > 0 and w.intra_node_bytes > 0
        assert w.quantized_gathers > 0
        # int8 weights move the losses a little, and only a little
        assert r["hpz"]["losses"] != r["stock"]["losses"]
        for got, want in zip(r["hpz"]["losses"], r["stock"]["losses"], strict=True):
            assert abs(got - want) < 1e-2
    assert len({tuple(r["hpz"]["losses"]) for r in results}) == 1
