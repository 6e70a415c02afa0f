"""A DCP checkpoint of a pipelined model reloads at another pp degree and training goes on
with the losses of an uninterrupted run: pp=2 x dp=2 -> pp=1 x dp=4, and back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import fsdp_ext
from fsdp_ext.testing import run_distributed
from tests.pipeline_cases import GLOBAL_BATCH, batches, loss_fn, make_model

STEPS, SPLIT = 4, 2


def _build(pp: int, seed: int):
    dims = fsdp_ext.ParallelDims(4, pp=pp)
    dims.build_mesh("cpu")
    schedule, stages = fsdp_ext.build_pipeline(
        make_model(seed=seed), dims, schedule="1F1B", n_microbatches=2, loss_fn=loss_fn
    )
    opts = [torch.optim.AdamW(s.submod.parameters(), lr=1e-2) for s in stages]
    return dims, schedule, stages, opts


def _train(dims, schedule, stages, opts, steps) -> list[float]:
    local = GLOBAL_BATCH // dims.dp
    rows = slice(dims.dp_flat_mesh.get_local_rank() * local, None)
    out = []
    for x, y in steps:
        x, y = x[rows][:local], y[rows][:local]
        losses = fsdp_ext.pipeline_step(schedule, stages, x, y)
        out.append(fsdp_ext.reduce_pipeline_loss(losses, stages, dims))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return out


def _state(stages, opts):
    return {"train": fsdp_ext.PipelineState([s.submod for s in stages], opts)}


def _resume_case(root: str) -> dict:
    data = batches(STEPS)
    out = {}
    for pp in (2, 1):
        out[f"uninterrupted_pp{pp}"] = _train(*_build(pp, seed=0), data)
    for save_pp, load_pp in ((2, 1), (1, 2)):
        path = f"{root}/pp{save_pp}"
        before = _build(save_pp, seed=0)
        first = _train(*before, data[:SPLIT])
        dcp.save(_state(*before[2:]), storage_writer=FileSystemWriter(path))
        after = _build(load_pp, seed=123)  # other weights: the load must replace them
        state = _state(*after[2:])
        dcp.load(state, storage_reader=FileSystemReader(path))
        out[f"pp{save_pp}_to_pp{load_pp}"] = first + _train(*after, data[SPLIT:])
    return out


def test_checkpoint_reloads_across_pp_degrees(tmp_path):
    results = run_distributed(_resume_case, 4, str(tmp_path))
    for rank, out in enumerate(results):
        reference = out["uninterrupted_pp2"]
        assert out["uninterrupted_pp1"] == pytest.approx(reference, abs=1e-5)
        for key in ("pp2_to_pp1", "pp1_to_pp2"):
            assert out[key] == pytest.approx(reference, abs=1e-5), (rank, key)
        assert reference[-1] < reference[0]  # it trains
