"""The codec seam: a codec written in this test module (one class and one registry call)
trains through FSDP2 on real gloo ranks, through the flat reduce-scatter and the HSDP hook,
and equals an independent single-process computation bit for bit. Also: checkpoints written
before codecs had names still resume bit for bit, and another codec's state is refused."""

import io
import itertools
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_ext import CommConfig, LoCoConfig, enable
from fsdp_ext.comm import Codec, register_codec, unregister_codec
from fsdp_ext.testing import WireCounter, run_distributed
from tests.meshes import cpu_mesh


class BFloat16Codec(Codec):
    """Every value rounded to bfloat16 on the wire: 2 bytes per element, no groups, no
    feedback. The whole codec: the test below needs nothing else."""

    def payload_bytes(self, numel):
        return 2 * numel

    def encode(self, rows, payload, feedback=None):
        payload.view(torch.bfloat16).copy_(rows)

    def decode_reduce(self, payload, out, *, out_scale=1.0):
        values = payload.view(torch.bfloat16).float()
        total = torch.zeros(values.shape[1])
        for row in values:
            total += row
        out.copy_(total * out_scale)

    def header(self):
        return {"wire_dtype": "bfloat16"}


@dataclass(frozen=True)
class BFloat16Options:
    """The codec's options: it has none but its name."""

    codec: ClassVar[str] = "bf16_test"


def _register():
    """The one registry line; each rank runs it in its own process, and the parent's is
    removed after (the codec stays out of the other tests' vocabulary)."""
    register_codec("bf16_test", lambda config: BFloat16Codec(), options=BFloat16Options)


@pytest.fixture(autouse=True)
def _bf16_registered():
    _register()
    yield
    unregister_codec("bf16_test")


WIDTHS = [48, 80, 48]


def _model(mesh=None):
    torch.manual_seed(0)
    mesh = cpu_mesh() if mesh is None else mesh
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS)))
    if mesh is not False:
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTHS[0], generator=gen), torch.randn(4, WIDTHS[-1], generator=gen)


def _local_grads(model, rank, step):
    model.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _bf16_mean(grads):
    """What the test codec delivers, derived here: each rank's gradient rounded to bf16,
    summed in fp32 in rank order, times 1/W."""
    total = torch.zeros_like(grads[0])
    for g in grads:
        total = total + g.to(torch.bfloat16).float()
    return total * (1.0 / len(grads))


def _train_flat(steps):
    _register()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    handle = enable(model, CommConfig(gradients="bf16_test"))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    wire = WireCounter().open()  # counted outside the library
    try:
        for step in range(steps):
            x, y = _batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            optim.step()
            optim.zero_grad()
    finally:
        wire.close()
    # the independent computation: one process, every rank's batch, the bf16 rule above
    ref = _model(mesh=False)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        per_rank = [_local_grads(ref, r, step) for r in range(world)]
        for p, *grads in zip(ref.parameters(), *per_rank, strict=True):
            p.grad = _bf16_mean(grads)
        ref_optim.step()
    params = [p.full_tensor() for p in model.parameters()]
    fp32_bytes = sum(p.numel() for p in ref.parameters()) * 4 * (world - 1) // world
    return dict(
        params=params,
        expected=[p.detach() for p in ref.parameters()],
        wire=wire.sent["all_to_all"],
        fp32_wire=fp32_bytes * steps,
        header=handle.header(),
        stats=handle.stats,
    )


def test_a_codec_defined_in_a_test_module_trains_through_fsdp():
    for out in run_distributed(_train_flat, 2, 3):
        for got, want in zip(out["params"], out["expected"], strict=True):
            assert torch.equal(got, want), float((got - want).abs().max())
        # bytes on the wire, counted outside the library: exactly half of fp32
        assert out["wire"] == out["fp32_wire"] // 2
        assert out["stats"].bytes_sent == out["wire"]
        assert out["header"]["codec"] == "bf16_test"
        assert out["header"]["wire_dtype"] == "bfloat16"


def _hsdp_grads():
    _register()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model(mesh=mesh["dp_shard"])
    enable(
        model, CommConfig(gradients="bf16_test"), replicate_group=mesh["dp_replicate"].get_group()
    )
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    got = [p.grad.full_tensor() for p in model.parameters()]
    # independent: shard group {0, 1} and {2, 3} reduce in bf16; then each replica's slice is
    # reduced over the replicas (bf16 on the wire) and gathered (bf16 again)
    ref = _model(mesh=False)
    per_rank = [_local_grads(ref, r, 0) for r in range(4)]
    expected = []
    for grads in zip(*per_rank, strict=True):
        replicas = [_bf16_mean(grads[0:2]), _bf16_mean(grads[2:4])]
        expected.append(_bf16_mean(replicas).to(torch.bfloat16).float())
    return got, expected


def test_a_codec_defined_in_a_test_module_runs_the_hsdp_hook():
    for got, expected in run_distributed(_hsdp_grads, 4):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e), float((g - e).abs().max())


class _LegacyFormat(Stateful):
    """Writes a CommHandle's state as every checkpoint before codecs had names did: the
    header without the ``codec`` and ``parameters`` keys (keys: world_size, bits,
    error_dtype, group_size, err_beta, intra_node_size, layout)."""

    def __init__(self, handle):
        self.handle = handle

    def state_dict(self):
        out = {}
        for key, blob in self.handle.state_dict().items():
            state = torch.load(io.BytesIO(blob), weights_only=True)
            del state["header"]["codec"]
            del state["header"]["parameters"]  # names and lengths came later still
            state["header"]["intra_node_size"] = state["header"].pop("node_size")
            assert set(state["header"]) == {
                "world_size",
                "bits",
                "error_dtype",
                "group_size",
                "err_beta",
                "intra_node_size",
                "layout",
            }
            buffer = io.BytesIO()
            torch.save(state, buffer)
            out[key] = buffer.getvalue()
        return out

    def load_state_dict(self, state):
        raise AssertionError("only saves")


def _fresh(config):
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, optim, enable(model, CommConfig(gradients=config))


def _train(model, optim, steps, start):
    for step in range(start, start + steps):
        x, y = _batch(dist.get_rank(), step)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()


def _legacy_resume(path):
    _register()
    config = LoCoConfig(group_size=32)
    model, optim, _ = _fresh(config)
    _train(model, optim, 8, 0)
    straight = [p.to_local().clone() for p in model.parameters()]
    model, optim, handle = _fresh(config)
    _train(model, optim, 4, 0)
    dcp.save({"model": model.state_dict(), "comm": _LegacyFormat(handle)}, checkpoint_id=path)
    model, optim, handle = _fresh(config)
    # SGD without momentum keeps no state: the model and the error buffers are the state
    state = {"model": model.state_dict(), "comm": handle}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    _train(model, optim, 4, 4)
    resumed = [p.to_local() for p in model.parameters()]
    # another codec cannot read LoCo's buffers: refused, naming the codec
    _, _, other = _fresh(BFloat16Options())
    try:
        dcp.load({"comm": other}, checkpoint_id=path)
        refused = ""
    except BaseException as exc:  # DCP wraps a rank's failure in a BaseException
        refused = str(exc)
    return straight, resumed, refused


def test_a_checkpoint_from_before_codec_names_resumes_bit_for_bit(tmp_path):
    for straight, resumed, refused in run_distributed(_legacy_resume, 2, str(tmp_path / "c")):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
        assert "codec=loco" in refused and "codec=bf16_test" in refused


def test_register_codec_refuses_bad_names_and_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_codec("loco", lambda config: BFloat16Codec(), options=BFloat16Options)
    with pytest.raises(ValueError, match="name must be an identifier other than 'stock'"):
        register_codec("", lambda config: BFloat16Codec(), options=BFloat16Options)
    with pytest.raises(ValueError, match="name must be an identifier other than 'stock'"):
        register_codec("stock", lambda config: BFloat16Codec(), options=BFloat16Options)
    with pytest.raises(ValueError, match="one of the library's codecs"):
        unregister_codec("loco")
    with pytest.raises(ValueError, match=r"CommConfig.gradients must be one of \['stock', "):
        CommConfig(gradients="nope")
