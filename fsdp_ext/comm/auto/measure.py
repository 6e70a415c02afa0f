"""The startup probe of ``--comm auto``: each hop's bandwidth and latency, the codecs' speed.

**Links.** Timed gloo all-gathers on the real groups: the intra-node groups (each node's
ranks) and the inter-node groups (one rank per node, same local index), every group of a
hop at once, as FSDP's traffic shares the links. The size doubles until one gather takes
``target_s`` and ten times a 4-byte gather; bandwidth is the slope between the last two
sizes (bytes per node link, or per rank stream inside a node), so a fixed cost per call and
a token bucket's burst both cancel; latency is the time of a 4-byte gather divided by its
ring steps. Every timing is the slowest rank's (an all-reduce of the maximum), so every
rank takes the same branches.

**Codecs.** Every registered codec, through the Codec contract alone (``encode``, with its
error feedback when it keeps one; ``decode_reduce`` for a gradient codec, ``decode`` for a
weight codec), on a large and a tiny sample, on every rank at once (ranks sharing a CPU slow
each other, as they will in training): per element from the large one, per call from the
tiny one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_ext._torch import all_gather_into
from fsdp_ext.comm.auto.cost import CodecSpeed, Hop, Measurements, codec_keys
from fsdp_ext.comm.codec import Codec
from fsdp_ext.comm.registry import CODECS, make_codec, preset

__all__ = ["codec_speed", "measure", "time_codecs"]

MIN_BYTES = 16 * 1024
MAX_BYTES = 16 * 1024 * 1024  # per rank and gather


def _slowest(seconds: float) -> float:
    """The maximum over every rank (so every rank branches alike)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed_gather(group: dist.ProcessGroup, nbytes: int, reps: int = 1) -> float:
    """Slowest rank's best time of an all-gather of ``nbytes`` per rank on ``group``."""
    best = float("inf")
    src = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    out = torch.empty(src.numel() * group.size(), dtype=torch.float32)
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        all_gather_into(out, src, group=group)
        best = min(best, time.perf_counter() - t0)
    return _slowest(best)


def _probe_hop(group, group_size: int, streams: int, target_s: float, budget_s: float) -> Hop:
    """Bandwidth (bytes/s on the shared link: ``streams`` gathers share it) and latency."""
    steps = group_size - 1
    tiny = _timed_gather(group, 4, reps=3)
    latency = tiny / steps
    # the bytes must outweigh the fixed cost (on a loaded machine a call alone takes tens
    # of ms) before the slope says anything about bandwidth
    enough = max(target_s, 10 * tiny)
    sizes, times = [], []
    nbytes = MIN_BYTES
    while True:
        sizes.append(nbytes)
        times.append(_timed_gather(group, nbytes, reps=1 if nbytes < MAX_BYTES // 8 else 2))
        spent = len(times) > 1 and sum(times) >= budget_s  # a loaded machine: stop in time
        if times[-1] >= enough or nbytes >= MAX_BYTES or spent:
            break
        nbytes *= 2
    if len(sizes) >= 2 and times[-1] > times[-2]:
        moved = streams * steps * (sizes[-1] - sizes[-2])
        bandwidth = moved / (times[-1] - times[-2])
    else:  # too fast to tell apart: the largest gather's rate, latency taken off
        bandwidth = streams * steps * sizes[-1] / max(times[-1] - steps * latency, 1e-9)
    return Hop(bandwidth=bandwidth, latency=latency)


def _node_groups(world: int, node_size: int):
    """This rank's (intra-node group, inter-node group); ``dist.new_group`` is collective,
    so every rank makes every group. None where a layout has no such hop."""
    me = dist.get_rank()
    nodes = world // node_size
    intra = inter = None
    if node_size > 1:
        for n in range(nodes):
            ranks = list(range(n * node_size, (n + 1) * node_size))
            pg = dist.new_group(ranks)
            if me in ranks:
                intra = pg
    if nodes > 1:
        for j in range(node_size):
            ranks = [n * node_size + j for n in range(nodes)]
            pg = dist.new_group(ranks)
            if me in ranks:
                inter = pg
    return intra, inter


def _time_call(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _calls(codec: Codec, weights: bool, n: int) -> dict[str, Callable[[], object]]:
    """One encode and one decode of ``codec`` on ``n`` elements (4 rows, as a reduce-scatter
    or an all-gather of 4 ranks)."""
    rows = 4
    width = max(1, n // rows)
    x = torch.randn(rows, width)
    payload = torch.empty(rows, codec.payload_bytes(width), dtype=torch.uint8)
    feedback = None
    if codec.keeps_feedback:
        feedback = codec.new_feedback(rows * codec.padded(width), x.device)
    codec.encode(x, payload)
    if weights:
        decoded = torch.empty(rows, width)
        decode = lambda: codec.decode(payload, decoded)  # noqa: E731
    else:
        out = torch.empty(width)
        decode = lambda: codec.decode_reduce(payload, out)  # noqa: E731
    return {"encode": lambda: codec.encode(x, payload, feedback), "decode": decode}


def _codec_calls(n: int) -> dict[str, Callable[[], object]]:
    """One call of each operation of every registered codec (its preset) on ``n``
    elements, by :func:`~fsdp_ext.comm.auto.cost.codec_keys`."""
    out = {}
    for name, entry in CODECS.items():
        weights = entry.carries == "weights"
        codec = make_codec(preset(name, entry.carries))
        for op, call in _calls(codec, weights, n).items():
            out[f"{name}_{op}"] = call
    return out


def codec_speed(per_call: float, whole: float, sample: int) -> CodecSpeed:
    """One codec's speed from the best time of a tiny call (``per_call``) and of a call on
    ``sample`` elements (``whole``). A noisy machine can time the large call no slower than
    the tiny one: per element keeps a floor of a tenth of the large call's own rate, so no
    codec is ever judged free (auto would then quantise everything)."""
    if not isinstance(sample, int) or sample < 1:
        raise ValueError(f"sample must be an int >= 1, got {sample!r}")
    per_element = max(whole - per_call, 0.1 * whole) / sample
    return CodecSpeed(per_call=per_call, per_element=per_element)


def time_codecs(
    tiny: dict[str, Callable[[], object]],
    large: dict[str, Callable[[], object]],
    sample: int,
    *,
    time_call: Callable[[Callable[[], object], int], float] = _time_call,
) -> dict[str, CodecSpeed]:
    """Time each codec's tiny and large call (``time_call(fn, reps)``: best seconds), in
    :func:`~fsdp_ext.comm.auto.cost.codec_keys` order; tests pass a fake ``time_call``."""
    out = {}
    for key in codec_keys():
        per_call = time_call(tiny[key], 3)
        whole = time_call(large[key], 2)
        out[key] = codec_speed(per_call, whole, sample)
    return out


def _probe_codecs(sample: int) -> dict[str, CodecSpeed]:
    tiny, large = _codec_calls(512), _codec_calls(sample)
    dist.barrier()  # every rank at once: ranks sharing cores slow each other
    return time_codecs(tiny, large, sample)


def measure(
    node_size: int,
    *,
    target_s: float = 0.1,
    budget_s: float = 0.6,
    codec_sample: int = 1 << 18,
) -> Measurements:
    """Measure this job's hops and codecs (collective: call on every rank of the default
    group, whose ranks ``g`` sit on node ``g // node_size``); each hop's doubling stops once
    its gathers took ``budget_s``. Each rank returns its own view;
    :func:`~fsdp_ext.comm.auto.decide.auto_config` combines them."""
    world = dist.get_world_size()
    if not isinstance(node_size, int) or node_size < 1 or world % node_size:
        raise ValueError(f"node_size must be an int >= 1 dividing world {world}, got {node_size!r}")
    t0 = time.perf_counter()
    intra_group, inter_group = _node_groups(world, node_size)
    nodes = world // node_size
    intra = inter = None
    if node_size > 1:
        intra = _probe_hop(intra_group, node_size, 1, target_s, budget_s)
    if nodes > 1:
        inter = _probe_hop(inter_group, nodes, node_size, target_s, budget_s)
    codecs = _probe_codecs(codec_sample)
    return Measurements(intra, inter, codecs, probe_s=time.perf_counter() - t0)
