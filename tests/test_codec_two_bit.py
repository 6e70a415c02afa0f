"""The codec seam from outside: ``tests/two_bit_codec.py`` (one file, one registry line)
runs the LoCo reduce-scatter on real gloo ranks, and its values equal a single-process
2-bit quantisation written here from the formula, bit for bit. The config asks the codec
which ``bits`` it takes."""

import pytest
import torch
import torch.distributed as dist

from fsdp_ext import LoCoConfig, LoCoReduceScatter
from fsdp_ext.testing import run_distributed
from tests import two_bit_codec  # noqa: F401  (registers "two_bit")

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
    rank = dist.get_rank()
    got = []
    for seed, shard in enumerate(SHARDS):
        inputs = _rank_inputs(world, shard, seed)
        comm = LoCoReduceScatter(LoCoConfig(codec="two_bit", bits=2, group_size=GROUP))
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


def test_config_asks_the_codec_which_bits_it_takes():
    assert LoCoConfig(codec="two_bit", bits=2, group_size=GROUP).bits == 2
    with pytest.raises(ValueError, match=r"codec='two_bit'.*takes bits=2, got bits=4"):
        LoCoConfig(codec="two_bit", group_size=GROUP)
    with pytest.raises(ValueError, match=r"codec='absmax'.*bits must be 4 or 8, got 2"):
        LoCoConfig(bits=2)
