"""The codec seam from outside: ``tests/two_bit_codec.py`` (one file, one registry line)
runs the reduce-scatter on real gloo ranks, and its values equal a single-process 2-bit
quantisation written here from the formula, bit for bit. The same line makes ``two_bit`` a
``CommConfig`` preset, a ``--comm`` choice and an ``auto`` candidate, priced through the
Codec contract. The codec owns its options and their limits."""

import pytest
import torch
import torch.distributed as dist

from fsdp_ext import CommConfig, LoCoConfig, LoCoReduceScatter
from fsdp_ext.comm import gradient_names, unregister_codec
from fsdp_ext.testing import run_distributed
from tests import two_bit_codec
from tests.two_bit_codec import TwoBitConfig


@pytest.fixture
def two_bit():
    two_bit_codec.register()
    yield
    unregister_codec("two_bit")


GROUP = 32
SHARDS = [64, 40, 7]  # whole groups, a padded one, one smaller than a group


def _rank_inputs(world, shard, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(world, world * shard, generator=gen)
    return x * torch.logspace(-1, 1, world).view(-1, 1)


def _two_bit(chunk):
    """The 2-bit round trip of one chunk, from the formula: groups of GROUP (zero padded),
    ``s = absmax``, ``q = clamp(floor(x / s + 0.5), -1, 1)``, value ``q * s``."""
    n = chunk.numel()
    padded = torch.zeros(-(-n // GROUP) * GROUP)
    padded[:n] = chunk
    out = []
    for group in padded.split(GROUP):
        s = group.abs().max()
        q = torch.floor(group / s + 0.5).clamp(-1, 1) if s > 0 else torch.zeros(GROUP)
        out.append(q * s)
    return torch.cat(out)[:n]


def _reference(inputs, world, shard, rank):
    total = torch.zeros(shard)
    for sender in range(world):  # float32, in rank order, then one multiplication by 1/W
        total += _two_bit(inputs[sender].view(world, shard)[rank])
    return total * torch.tensor(1 / world, dtype=torch.float32)


def _reduce_scatter(world):
    two_bit_codec.register()  # in this rank's process
    rank = dist.get_rank()
    got = []
    for seed, shard in enumerate(SHARDS):
        inputs = _rank_inputs(world, shard, seed)
        comm = LoCoReduceScatter(TwoBitConfig(group_size=GROUP))
        out = torch.empty(shard)
        comm(out, inputs[rank].clone(), dist.group.WORLD, dist.ReduceOp.AVG)  # as FSDP calls
        got.append((shard, out, _reference(inputs, world, shard, rank), comm.stats.bytes_sent))
    return got


@pytest.mark.parametrize("world", [3])  # a world that is not a power of two
def test_two_bit_codec_reduce_scatter_equals_single_process_reference(world):
    for results in run_distributed(_reduce_scatter, world, world):
        for shard, out, expected, sent in results:
            assert torch.equal(out, expected), (shard, float((out - expected).abs().max()))
            # 2 bits a value plus one fp32 scale a group, to each of the W - 1 peers
            groups = -(-shard // GROUP)
            assert sent == (world - 1) * groups * (GROUP // 4 + 4)


def test_the_codec_owns_its_options_and_their_limits(two_bit):
    assert TwoBitConfig(group_size=GROUP).group_size == GROUP
    with pytest.raises(ValueError, match="group_size must be a multiple of 16, got 24"):
        TwoBitConfig(group_size=24)
    with pytest.raises(ValueError, match=r"LoCoConfig: bits must be 4 or 8, got 2"):
        LoCoConfig(bits=2)


def test_one_file_and_one_registry_line_reach_comm_presets_and_auto(two_bit):
    """``--comm two_bit``, ``CommConfig(gradients="two_bit")`` and an ``auto`` candidate,
    with nothing written for it but the codec file and its registry line; ``auto`` prices it
    through the Codec contract (its payload bytes and its measured calls) and picks it where
    its bytes win."""
    from examples.config import build_parser, comm_settings, parse_args
    from fsdp_ext.comm.auto import (
        CodecSpeed,
        Hop,
        Layout,
        Measurements,
        candidates,
        choose,
        codec_keys,
    )
    from fsdp_ext.comm.auto.measure import _codec_calls

    assert "two_bit" in gradient_names()
    assert CommConfig(gradients="two_bit").gradients == TwoBitConfig()
    comm = next(a for a in build_parser()._actions if a.dest == "comm")
    assert "two_bit" in comm.choices
    cfg = parse_args(["--comm", "two_bit", "--comm-group-size", "64"])
    assert comm_settings(cfg, 1).gradients == TwoBitConfig(group_size=64)
    layout = Layout(world=4, node_size=2)
    assert {c.gradients for c in candidates(layout)} >= {"two_bit"}
    assert {"two_bit_encode", "two_bit_decode"} <= set(_codec_calls(512)) == set(codec_keys())
    free = CodecSpeed(0.0, 0.0)
    slow_link = Measurements(Hop(1e9, 0.0), Hop(1e6, 0.0), dict.fromkeys(codec_keys(), free))
    decision = choose(layout, slow_link, [[], [1 << 16]], tolerance=0.0)
    assert decision.choice.gradients == "two_bit"
    assert decision.comm_config().gradients == TwoBitConfig(group_size=128)
