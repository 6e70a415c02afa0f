"""Error state keyed to parameters: unused parameters, frozen parameters, units of several
modules, one comm per unit. Real FSDP2 backward passes on 2 gloo ranks, checked against the
exact fp32 mean gradient and an independent single-process model of error feedback."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_ext import CommConfig, LoCoConfig, LoCoReduceScatter, enable
from fsdp_ext.comm.absmax_codec import AbsmaxCodec
from fsdp_ext.comm.error_feedback import ErrorFeedback
from fsdp_ext.comm.layout import ParamLayout
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh

WORLD, GROUP, BETA, DIM = 2, 32, 0.8, 32


class TwoBranches(nn.Module):
    """Same-shaped branches a and b; each step uses one. a's gradients are ~1000x b's."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x, use_a):
        return self.a(x) * 10.0 if use_a else self.b(x) * 0.01


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, DIM, generator=gen), torch.randn(8, DIM, generator=gen)


USES_A = [True, False, True, False, False, True]  # b twice in a row too
PARAMS = ["a.weight", "a.bias", "b.weight", "b.bias"]


def _per_rank_grads(model, step, use_a):
    """Each rank's full (unsharded) gradients, computed in one process."""
    grads = []
    for rank in range(WORLD):
        model.zero_grad(set_to_none=True)
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x, use_a), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads


def _reference_error_feedback(model):
    """What LoCo should deliver, re-derived per parameter: sender r keeps, for each parameter
    and destination d, the error of that parameter's chunk d; only present parameters are
    quantised (in FSDP's row layout, padded to whole groups) and only their error moves."""
    errors = {
        r: {n: torch.zeros(WORLD, p.numel() // WORLD) for n, p in model.named_parameters()}
        for r in range(WORLD)
    }
    outputs, bounds = [], []
    for step, use_a in enumerate(USES_A):
        grads = _per_rank_grads(model, step, use_a)
        present = [n for n in PARAMS if n in grads[0]]
        sizes = [grads[0][n].numel() // WORLD for n in present]
        width = sum(sizes)
        padded = -(-width // GROUP) * GROUP
        out = torch.zeros(WORLD, padded)
        half_steps = torch.zeros(WORLD, padded)
        for r in range(WORLD):
            g = torch.cat([grads[r][n].reshape(WORLD, -1) for n in present], dim=1)
            e = torch.cat([errors[r][n] for n in present], dim=1)
            h = torch.zeros(WORLD, padded)
            h[:, :width] = g + e
            groups = h.view(WORLD, -1, GROUP)
            s = groups.abs().amax(-1, keepdim=True) / 7
            q = torch.floor(groups / torch.where(s > 0, s, 1) + 0.5).clamp(-8, 7)
            sent = (q * s).view(WORLD, padded)
            new_e = BETA * torch.cat([e, torch.zeros(WORLD, padded - width)], 1) + (1 - BETA) * (
                h - sent
            )
            for n, part in zip(present, new_e[:, :width].split(sizes, dim=1), strict=True):
                errors[r][n] = part.clone()
            out += sent / WORLD
            # one half-step of this step's scale, plus the error carried in (h = g + e)
            half_steps += (s / 2).expand(-1, -1, GROUP).reshape(WORLD, padded) / WORLD
            half_steps[:, :width] += e.abs() / WORLD
        exact = sum(torch.cat([g[n].reshape(WORLD, -1) for n in present], 1) for g in grads)
        outputs.append((present, sizes, out[:, :width], exact / WORLD))
        bounds.append(half_steps[:, :width])
    return outputs, bounds, errors


def _unused_branch():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoBranches()
    fully_shard(model, mesh=cpu_mesh())
    handle = enable(
        model,
        CommConfig(
            gradients=LoCoConfig(group_size=GROUP, err_beta=BETA, error_dtype=torch.float32)
        ),
    )
    grads = []
    for step, use_a in enumerate(USES_A):
        model.zero_grad(set_to_none=True)
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x, use_a), y).backward()
        grads.append(
            {
                n: p.grad.to_local().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
    feedback = handle._units["<root>"].reduce_scatter.feedback
    return grads, feedback.error.clone(), feedback.reductions


def test_unused_parameter_keeps_its_own_error():
    """Step 1 uses a, step 2 uses b, ...: every step's gradients are within the quantisation
    bound of the exact mean (half a step per sender, plus the error it carried in) and equal
    the per-parameter error-feedback model; b never receives a's error (on the positional
    layout b came out off by ~100x its size)."""
    per_rank = run_distributed(_unused_branch, WORLD)
    torch.manual_seed(0)
    reference = TwoBranches()
    outputs, bounds, errors = _reference_error_feedback(reference)
    for rank, (grads, error, reductions) in enumerate(per_rank):
        assert reductions == len(USES_A)
        for step, ((present, _, want, exact), bound) in enumerate(
            zip(outputs, bounds, strict=True)
        ):
            got = torch.cat([grads[step][n].reshape(-1) for n in present])
            assert sorted(grads[step]) == sorted(present), step
            err = (got - exact[rank]).abs()
            assert bool((err <= bound[rank] * (1 + 1e-5) + 1e-7).all()), (step, float(err.max()))
            scale = float(exact[rank].abs().max())
            assert torch.allclose(got, want[rank], atol=1e-5 * scale, rtol=0), step
        # the library's error, column by column, is the per-parameter model's error
        full = error.view(WORLD, -1)
        expect = torch.cat([errors[rank][n] for n in PARAMS], dim=1)
        assert torch.allclose(full[:, : expect.shape[1]], expect, atol=1e-6), rank


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM)
        self.body = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def _units_and_checkpoints(path):
    rank = dist.get_rank()
    out = {}
    # several modules, one unit (torchtitan's fully_shard([norm, output])), plus a frozen param
    torch.manual_seed(1)
    model = Block()
    model.body.bias.requires_grad_(False)
    fully_shard([model.norm, model.head], mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    handle = enable(model, CommConfig(gradients=LoCoConfig(group_size=GROUP)))
    x, y = _batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    dcp.save({"comm": handle}, checkpoint_id=path)  # frozen and grouped units both save
    out["saved"] = True
    out["units"] = sorted(handle._units)
    out["layouts"] = {f: u.binding.layout.names for f, u in handle._units.items()}
    out["stats"] = handle.stats.reductions
    out["grads"] = {
        n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None
    }
    # one comm object on two units is refused with a clear error
    torch.manual_seed(1)
    other = Block()
    fully_shard(other.body, mesh=cpu_mesh())
    fully_shard(other.head, mesh=cpu_mesh())
    fully_shard(other, mesh=cpu_mesh())
    comm = LoCoReduceScatter(LoCoConfig(group_size=GROUP))
    comm.install(other.body)
    with pytest.raises(ValueError, match="already serves unit") as exc:
        comm.install(other.head)
    out["two_units"] = str(exc.value)
    return out


def test_grouped_unit_frozen_params_and_one_comm_per_unit(tmp_path):
    per_rank = run_distributed(_units_and_checkpoints, WORLD, str(tmp_path / "ckpt"))
    torch.manual_seed(1)
    ref = Block()
    ref.body.bias.requires_grad_(False)
    for rank in range(WORLD):
        x, y = _batch(0, rank)
        nn.functional.mse_loss(ref(x), y).backward()
    for out in per_rank:
        assert out["units"] == ["<root>", "norm+head"]
        # one comm sized over both modules' parameters; the frozen bias is not counted
        assert out["layouts"]["norm+head"] == (
            "norm.weight",
            "norm.bias",
            "head.weight",
            "head.bias",
        )
        assert out["layouts"]["<root>"] == ("body.weight",)
        assert out["stats"] == 2 and out["saved"]
        assert "body.bias" not in out["grads"]
        for n, g in out["grads"].items():
            exact = dict(ref.named_parameters())[n].grad / WORLD
            assert float((g - exact).norm() / exact.norm()) < 0.25, n
        assert "serves unit" in out["two_units"] and "own comm" in out["two_units"]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 70), min_size=1, max_size=6),
    st.data(),
    st.integers(1, 4),
)
def test_layout_maps_every_present_element_once(lengths, data, parts):
    """Columns of any subset land in their own parameters' segments, in order; the replica
    slices of a subset cover each of its elements exactly once and stay inside the full
    layout's slice of the same parameters."""
    layout = ParamLayout([f"p{i}" for i in range(len(lengths))], lengths)
    present = tuple(sorted(data.draw(st.sets(st.integers(0, len(lengths) - 1), min_size=1))))
    cols = layout.columns(present, torch.device("cpu"))
    expect = [layout.offsets[i] + j for i in present for j in range(lengths[i])]
    assert cols.tolist() == expect
    numel = layout.width_of(present)
    index = layout.slice_index(present, parts, torch.device("cpu"))
    real = index[index < numel]
    assert sorted(real.tolist()) == list(range(numel))
    pieces = layout.split(parts)
    assert index.shape == (parts, pieces.width_of(present))


def test_int8_error_subset_keeps_absent_parameters():
    """A reduction holding parameters 0 and 2 of three updates only their error; parameter 1
    keeps its error (up to the int8 re-rounding of the groups it shares)."""
    config = LoCoConfig(group_size=32, error_dtype=torch.int8)
    feedback = ErrorFeedback(AbsmaxCodec.from_config(config), config.reset_interval)
    layout = ParamLayout(["a", "b", "c"], [40, 30, 26])  # 96 = 3 groups per row
    rows, full_width = 2, 96
    feedback.materialize(rows * full_width, torch.device("cpu"))
    start = torch.randn(rows * full_width, generator=torch.Generator().manual_seed(0))
    feedback.encode(start)
    before = feedback.decoded().clone().view(rows, full_width)
    cols = layout.columns((0, 2), torch.device("cpu"))
    subset = feedback.subset(rows, full_width, cols, 96)
    state = subset.next(rows * 96, torch.device("cpu"))
    part = state.error
    assert state.error_scales is None and part.dtype == torch.float32
    assert torch.equal(part.view(rows, 96)[:, :66], before[:, cols])  # gathered by parameter
    part.view(rows, 96)[:, :66] = 5.0  # what the kernel would write
    subset.write_back()
    after = feedback.decoded().view(rows, full_width)
    half_step = feedback.error_scales.view(rows, -1).repeat_interleave(32, dim=1) / 2
    assert bool(((after[:, cols] - 5.0).abs() <= half_step[:, cols] * (1 + 1e-6)).all())
    absent = torch.arange(40, 70)
    drift = (after[:, absent] - before[:, absent]).abs()
    assert bool((drift <= half_step[:, absent] * (1 + 1e-6)).all())
    assert feedback.reductions == 1
