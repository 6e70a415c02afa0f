"""qwZ: FSDP2's parameter all-gather with int8 weights, against single-process references.

The references rebuild, by hand and without FSDP, what each rank's all-gather input is
(every parameter of a unit padded on dim 0 to a multiple of the world size, rank r's
dim-0 chunk of each, concatenated in module order), quantise each rank's row with the
kernel reference, and put the dequantised values back into an ordinary model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_ext
from fsdp_ext.comm.blockwise_int8_codec import BlockwiseInt8Codec
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.kernels.backend import use_backend
from fsdp_ext.kernels.quantize_blockwise import (
    dequantize_blockwise_reference,
    payload_row_bytes,
    quantize_blockwise_reference,
)
from fsdp_ext.testing import run_distributed

DIM, HIDDEN, DIN, DOUT = 13, 40, 7, 5  # odd sizes: dim-0 padding on 2 ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIN, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, DOUT)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _units(net: Net) -> list[tuple[str, nn.Module, list[str]]]:
    """(prefix, module, parameter names in module order) of each FSDP unit of the tests."""
    units = [
        (f"blocks.{i}.", block, [n for n, _ in block.named_parameters()])
        for i, block in enumerate(net.blocks)
    ]
    root = [n for n, _ in net.named_parameters() if not n.startswith("blocks.")]
    return [("", net, root), *units]


def quantized_copy(
    net: Net, world: int, group_size: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """What every rank computes with under qwZ, by hand: each parameter padded on dim 0 to
    a multiple of the world, cut into one dim-0 chunk per rank, each chunk quantised on its
    own groups (no group mixes two parameters or two ranks), dequantised, put back."""
    out = {}
    for prefix, unit, names in _units(net):
        params = dict(unit.named_parameters())
        for name in names:
            p = params[name].detach().to(dtype)
            chunk = -(-p.shape[0] // world)
            padded = p.new_zeros(world * chunk, *p.shape[1:])
            padded[: p.shape[0]] = p
            rows = padded.reshape(world, -1)
            payload = torch.empty(
                world, payload_row_bytes(rows.shape[1], group_size), dtype=torch.uint8
            )
            quantize_blockwise_reference(rows, payload, group_size=group_size)
            back = torch.empty_like(rows)
            dequantize_blockwise_reference(payload, back, group_size=group_size)
            out[prefix + name] = back.reshape(padded.shape)[: p.shape[0]].clone()
    return out


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, DIN, generator=g), torch.randn(rows, DOUT, generator=g)


def _shard(net: Net, mesh, **kwargs) -> None:
    for block in net.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)


def _full(tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _qwz_steps_rank(steps: int, group_size: int, backend: str = "auto") -> dict:
    with use_backend(backend):
        return _qwz_steps(steps, group_size)


def _qwz_steps(steps: int, group_size: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = Net()
    _shard(net, mesh)
    handle = fsdp_ext.register_weight_all_gather(
        net, fsdp_ext.WeightQuantConfig(group_size=group_size)
    )
    seen = []
    net.blocks[1].up.register_forward_pre_hook(lambda m, _: seen.append(m.weight.detach().clone()))
    optim = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        local = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        loss = F.mse_loss(net(x[local]), y[local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {
        "losses": losses,
        "params": {n: _full(p).detach().clone() for n, p in net.named_parameters()},
        "dtypes": {n: p.to_local().dtype for n, p in net.named_parameters()},
        "seen": seen,
        "stats": handle.stats,
        "units": handle.units,
    }


def _reference_steps(steps: int, world: int, group_size: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    optim = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    losses, seen = [], []
    for step in range(steps):
        quantized = quantized_copy(net, world, group_size)
        seen.append(quantized["blocks.1.up.weight"])
        compute = Net()
        compute.load_state_dict(quantized)
        x, y = _batch(step)
        loss = F.mse_loss(compute(x), y)
        loss.backward()
        for p, q in zip(net.parameters(), compute.parameters(), strict=True):
            p.grad = q.grad
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": dict(net.named_parameters()), "seen": seen}


def test_qwz_steps_equal_a_single_process_run_on_quantized_weights():
    """Two SGD steps on 2 gloo ranks with qwZ equal one process that computes with the
    hand-quantised weights and updates the full-precision ones, to 1e-6; the shards the
    optimizer updates stay fp32 (they equal the reference's unquantised update)."""
    ranks = run_distributed(_qwz_steps_rank, 2, 2, 32)
    ref = _reference_steps(2, 2, 32)
    for r in ranks:
        assert r["units"] == ["<root>", "blocks.0", "blocks.1"]
        assert all(d == torch.float32 for d in r["dtypes"].values())
        for got, want in zip(r["seen"], ref["seen"], strict=True):
            assert torch.equal(got, want)  # forward computes with exactly these weights
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        for name, want in ref["params"].items():
            torch.testing.assert_close(r["params"][name], want.detach(), atol=1e-6, rtol=0)
        stats = r["stats"]
        # forward and backward gathers of both blocks, forward of the root, per step
        assert stats.quantized_gathers == 2 * (2 * 2 + 1)
        assert stats.full_precision_gathers == stats.intra_node_gathers == 0
    # the weights the optimizer holds are not the quantised ones
    q = quantized_copy_from(ref["params"])
    assert not torch.equal(q["blocks.1.up.weight"], ref["params"]["blocks.1.up.weight"])


@pytest.mark.usefixtures("triton_interpreter")
def test_qwz_runs_the_triton_kernels_on_the_data_path():
    """The same step with the Triton kernels (interpreted) inside FSDP's all-gather: the
    weights forward computes with and the updated shards equal the torch path's bit for bit."""
    triton = run_distributed(_qwz_steps_rank, 2, 1, 64, "triton")
    torch_path = run_distributed(_qwz_steps_rank, 2, 1, 64, "reference")
    for t, r in zip(triton, torch_path, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(t["seen"], r["seen"], strict=True))
        assert t["losses"] == r["losses"]
        assert all(torch.equal(t["params"][n], r["params"][n]) for n in r["params"])


def quantized_copy_from(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    net = Net()
    net.load_state_dict({n: p.detach() for n, p in params.items()})
    return quantized_copy(net, 2, 32)


def _capture(module: nn.Module, forward: list, backward: list) -> None:
    """Record ``module.weight`` when its forward runs and when its output's gradient
    arrives (the unit around it has gathered again for backward by then)."""

    def hook(mod, _inputs, output):
        forward.append(mod.weight.detach().clone())
        if output.requires_grad:
            output.register_hook(lambda grad: backward.append(mod.weight.detach().clone()))

    module.register_forward_hook(hook)


def _options_rank(group_size: int) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, config, mp in [
        ("bf16", fsdp_ext.WeightQuantConfig(group_size=group_size), torch.bfloat16),
        ("forward_only", fsdp_ext.WeightQuantConfig(group_size=group_size, backward=False), None),
    ]:
        torch.manual_seed(0)
        net = Net()
        kwargs = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=mp)}
        _shard(net, mesh, **kwargs)
        handle = fsdp_ext.register_weight_all_gather(net, config)
        forward, backward = [], []
        _capture(net.blocks[0].up, forward, backward)
        x, y = _batch(0)
        F.mse_loss(net(x.to(mp or torch.float32)).float(), y).backward()
        out[name] = {"forward": forward[:], "backward": backward[:], "stats": handle.stats}
        handle.remove()
        F.mse_loss(net(x.to(mp or torch.float32)).float(), y).backward()
        out[name]["after_remove"] = forward[-1]
    return out


def test_mixed_precision_and_forward_only():
    """bf16 params: the weights are quantised from the bf16 cast and come back as bf16,
    forward and backward alike. ``backward=False``: backward computes with the exact
    weights. ``remove()`` gives the stock all-gather back."""
    torch.manual_seed(0)
    exact = Net()
    want_bf16 = quantized_copy(exact, 2, 32, torch.bfloat16)["blocks.0.up.weight"]
    want_fp32 = quantized_copy(exact, 2, 32)["blocks.0.up.weight"]
    for r in run_distributed(_options_rank, 2, 32):
        bf16 = r["bf16"]
        assert bf16["forward"][0].dtype == torch.bfloat16
        assert torch.equal(bf16["forward"][0], want_bf16)
        assert torch.equal(bf16["backward"][0], want_bf16)
        assert torch.equal(bf16["after_remove"], exact.blocks[0].up.weight.detach().bfloat16())
        fwd = r["forward_only"]
        assert torch.equal(fwd["forward"][0], want_fp32)
        assert torch.equal(fwd["backward"][0], exact.blocks[0].up.weight.detach())
        # the two blocks' backward gathers, and the root's one gather (backward reuses it)
        assert fwd["stats"].full_precision_gathers == 3
        assert fwd["stats"].quantized_gathers == 2


def test_the_weight_codec_keeps_the_seams_contract():
    """``int8`` through the codec seam: payload size, decode of every row, and
    decode_reduce = the fp32 sum of the decoded rows in row order, scaled once, cast once."""
    codec = make_codec(fsdp_ext.WeightQuantConfig(group_size=64))
    rows = torch.randn(3, 150, generator=torch.Generator().manual_seed(3))
    payload = torch.empty(3, codec.payload_bytes(150), dtype=torch.uint8)
    assert payload.shape[1] == 3 * (64 + 4) and codec.padded(150) == 192
    codec.encode(rows, payload)
    decoded = torch.empty(3, 150)
    codec.decode(payload, decoded)
    assert (decoded - rows).abs().max() <= rows.abs().max() / 127 / 2 * 1.001
    out = torch.empty(150, dtype=torch.bfloat16)
    codec.decode_reduce(payload, out, out_scale=1 / 3)
    want = ((decoded[0] + decoded[1]) + decoded[2]) * torch.tensor(1 / 3)
    assert torch.equal(out, want.bfloat16())
    assert codec.header() == {"bits": 8, "group_size": 64} and not codec.keeps_feedback
    # every group size the config accepts has a CUDA kernel: nothing fails after parsing
    for group_size in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        make_codec(fsdp_ext.WeightQuantConfig(group_size=group_size)).check_device(
            torch.device("cuda")
        )
    with pytest.raises(ValueError, match="group_size in"):
        BlockwiseInt8Codec(8192).check_device(torch.device("cuda"))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"bits": 4}, "bits must be 8"),
        ({"group_size": 100}, "group_size must be a power of two >= 4, got 100"),
        (
            {"group_size": 16},
            r"Triton kernels take group_size in \(32, .*4096\); got group_size=16",
        ),
        ({"backward": "yes"}, "backward must be a bool"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        fsdp_ext.WeightQuantConfig(**kwargs)
