"""The cost model of ``--comm auto``: predicted communication time per step of each candidate.

A candidate picks, per collective and per hop, how FSDP2's traffic travels:

- the **weight all-gather**: the parameter dtype (``stock``) or a weight codec (``int8``,
  qwZ), forward and backward or forward only (``int8_forward``);
- **hpZ**: the backward all-gather stays inside the node (each unit keeps its post-forward
  copy sharded over the node's ranks);
- the **gradient reduce-scatter**: fp32 (``stock``) or a gradient codec (``q4``, ``loco`` and
  every other registered one), either flat (over every rank) or hierarchical (fp32 inside
  the node, the codec across);
- the **HSDP all-reduce** (with replicas): it follows the gradient codec, as
  ``enable(..., replicate_group=...)`` installs one codec on both.

The time of one collective is ``bytes / bandwidth + latency x messages`` on its slowest hop,
plus the codec's time (``per_call x calls + per_element x elements``), each from a
:class:`Measurements` taken at startup (:mod:`fsdp_ext.comm.auto.measure`). The collectives
follow gloo's algorithms as measured in the lab (docs/cluster.md): a ring all-gather (W - 1
steps of one shard), the reduce-scatter as a ring all-reduce of the whole input (2 (W - 1)
steps of one shard), a direct all-to-all (one round, every peer at once). Nodes hold
consecutive ranks. Every codec is priced through the Codec contract alone: its payload bytes
(``unit_payload_bytes``), whether a unit is sent encoded or raw (a unit whose payload would
not be smaller than its raw bytes goes raw, with no codec time:
:func:`~fsdp_ext.comm.codec.choose_wire`, as the collectives call it) and its measured
encode / decode time; the names are the registry's (:mod:`fsdp_ext.comm.registry`), so a
codec registered there is a candidate here with nothing else to write.

Compute is the same for every candidate and not predicted: the figures are the
communication and codec milliseconds a step adds, which is what the choice compares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fsdp_ext.comm.codec import Codec, WireChoice, choose_wire
from fsdp_ext.comm.registry import (
    CODECS,
    FORWARD_ONLY,
    STOCK,
    gradient_names,
    make_codec,
    preset,
    weight_names,
)

__all__ = [
    "Candidate",
    "CodecSpeed",
    "Hop",
    "Layout",
    "Measurements",
    "Prediction",
    "candidates",
    "codec_keys",
    "predict",
]

FP32 = 4


@dataclass(frozen=True)
class Hop:
    """One hop's link: ``bandwidth`` in bytes/s (inter-node: the node's link, each way, shared
    by the node's ranks; intra-node: one rank's stream with every rank busy) and ``latency``,
    seconds per message (one step of a ring, one round of an all-to-all)."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not math.isfinite(self.bandwidth):
            raise ValueError(f"Hop.bandwidth must be a finite number > 0, got {self.bandwidth!r}")
        if not self.latency >= 0 or not math.isfinite(self.latency):
            raise ValueError(f"Hop.latency must be a finite number >= 0, got {self.latency!r}")


@dataclass(frozen=True)
class CodecSpeed:
    """Seconds of one codec call on ``n`` elements: ``per_call + per_element * n``."""

    per_call: float
    per_element: float

    def seconds(self, elements: float, calls: int = 1) -> float:
        return calls * self.per_call + elements * self.per_element


def codec_keys() -> tuple[str, ...]:
    """The speeds a prediction needs: ``<codec>_encode`` and ``<codec>_decode`` of every
    registered codec (a gradient codec's decode is its ``decode_reduce``)."""
    return tuple(f"{name}_{op}" for name in CODECS for op in ("encode", "decode"))


def weight_codec_name(weights: str) -> str:
    """The codec of a weights name (``int8_forward`` -> ``int8``)."""
    return weights.removesuffix(FORWARD_ONLY)


@dataclass(frozen=True)
class Measurements:
    """What the startup probe measured: the two hops (None where a layout has no such hop)
    and the codecs' speeds by :func:`codec_keys`."""

    intra: Hop | None
    inter: Hop | None
    codecs: dict[str, CodecSpeed]
    probe_s: float = 0.0  # how long measuring took

    def __post_init__(self) -> None:
        missing = [k for k in codec_keys() if k not in self.codecs]
        if missing:
            raise ValueError(f"Measurements.codecs lacks {missing}; it needs {list(codec_keys())}")


@dataclass(frozen=True)
class Layout:
    """The job's shape: ``world`` ranks, ``node_size`` per node (consecutive ranks), FSDP's
    shard group of ``world / replicas`` ranks (``replicas > 1``: HSDP), the parameter dtype's
    bytes, and the group sizes of the codecs whose wire choices it predicts."""

    world: int
    node_size: int
    replicas: int = 1
    param_bytes: int = FP32
    grad_group_size: int = 128
    weight_group_size: int = 256

    def __post_init__(self) -> None:
        for name in ("world", "node_size", "replicas"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {v!r}")
        if self.world % self.node_size or self.world % self.replicas:
            raise ValueError(
                f"Layout: node_size {self.node_size} and replicas {self.replicas} must divide "
                f"world {self.world}"
            )
        if self.param_bytes not in (2, 4):
            raise ValueError(f"Layout.param_bytes must be 2 or 4, got {self.param_bytes!r}")

    @property
    def shard(self) -> int:
        return self.world // self.replicas

    @property
    def nodes(self) -> int:
        return self.world // self.node_size

    def gradient_config(self, name: str) -> object | None:
        """The options gradient name ``name`` stands for on this job (None: stock)."""
        return preset(name, "gradients", group_size=self.grad_group_size)

    def weight_config(self, name: str) -> object | None:
        """The options weights name ``name`` stands for on this job (None: stock)."""
        return preset(name, "weights", group_size=self.weight_group_size)

    def codec(self, name: str) -> Codec:
        """Registered codec ``name`` at this job's group sizes (built once per layout)."""
        cache = self.__dict__.setdefault("_codecs", {})
        if name not in cache:
            weights = CODECS[name].carries == "weights"
            config = self.weight_config(name) if weights else self.gradient_config(name)
            cache[name] = make_codec(config)
        return cache[name]

    def grad_wire(self, gradients: str, n: int) -> WireChoice:
        """A gradient row of ``n`` fp32 values, as ``LoCoReduceScatter.wire_for`` sends it."""
        return choose_wire(self.codec(gradients), [n], FP32)

    def weight_wire(self, weights: str, shards: Sequence[int]) -> WireChoice:
        """A unit's weight row (each parameter's shard encoded on its own), as
        ``QuantizedWeightAllGather.wire_for`` sends it in the parameter dtype (stock: plain)."""
        if weights == STOCK:
            return WireChoice(False, 0, sum(shards) * self.param_bytes)
        return choose_wire(self.codec(weight_codec_name(weights)), shards, self.param_bytes)


@dataclass(frozen=True, order=True)
class Candidate:
    """One way to communicate (see the module docstring), in the registry's names:
    ``weights`` one of :func:`~fsdp_ext.comm.registry.weight_names`, ``gradients`` one of
    :func:`~fsdp_ext.comm.registry.gradient_names`; :meth:`AutoDecision.comm_config` turns
    it into the ``CommConfig`` of the same names."""

    weights: str = STOCK
    hpz: bool = False
    gradients: str = STOCK
    hierarchical: bool = False

    def __post_init__(self) -> None:
        if self.weights not in weight_names():
            raise ValueError(
                f"Candidate.weights must be one of {list(weight_names())}, got {self.weights!r}"
            )
        if self.gradients not in gradient_names():
            raise ValueError(
                f"Candidate.gradients must be one of {list(gradient_names())}, got "
                f"{self.gradients!r}"
            )
        if self.hierarchical and self.gradients == STOCK:
            raise ValueError("Candidate.hierarchical needs a gradient codec, not stock")
        if self.hpz and self.weights.endswith(FORWARD_ONLY):
            raise ValueError(
                f"Candidate: hpZ keeps backward gathers in the node; use "
                f"{weight_codec_name(self.weights)}, not {self.weights}"
            )

    @property
    def lossy_parts(self) -> int:
        """How much of the training signal is quantised (ties go to fewer): quantised
        weights count 2 (forward and backward) or 1 (forward only); gradients 2 for a codec
        without error feedback, 1 for one with it (LoCo), halved when only the inter-node
        hop is quantised."""
        w = 0 if self.weights == STOCK else 1 if self.weights.endswith(FORWARD_ONLY) else 2
        g = 0
        if self.gradients != STOCK:
            g = 1 if make_codec(preset(self.gradients)).keeps_feedback else 2
        return 2 * w + (g if self.hierarchical else 2 * g)

    @property
    def name(self) -> str:
        parts = [f"weights={self.weights}", "hpZ" if self.hpz else "noHPZ"]
        parts.append(f"grads={self.gradients}" + ("/hier" if self.hierarchical else ""))
        return " ".join(parts)


@dataclass
class Prediction:
    """Seconds per step of one candidate, by collective, and the total."""

    candidate: Candidate
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def add(self, key: str, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds


def candidates(layout: Layout) -> list[Candidate]:
    """Every candidate that differs on this layout: no hpZ or hierarchical mode where a node
    holds one rank or the shard group one node."""
    spans_nodes = layout.nodes > 1 and layout.node_size > 1
    out = []
    for weights in weight_names():
        for hpz in (False, True) if spans_nodes else (False,):
            if hpz and weights.endswith(FORWARD_ONLY):
                continue
            for gradients in gradient_names():
                for hier in (False, True) if spans_nodes and gradients != STOCK else (False,):
                    out.append(Candidate(weights, hpz, gradients, hier))
    return out


# ---------------------------------------------------------------- gloo's collectives


class _Net:
    """Times of gloo's collectives on one layout's hops."""

    def __init__(self, layout: Layout, m: Measurements):
        self.layout, self.m = layout, m

    def _hop(self, spans_nodes: bool) -> Hop:
        hop = self.m.inter if spans_nodes else self.m.intra
        if hop is None:
            raise ValueError(
                f"Measurements lack the {'inter' if spans_nodes else 'intra'}-node hop this "
                f"layout needs ({self.layout})"
            )
        return hop

    def ring(self, steps: int, message: float, ranks: int, per_node: int) -> float:
        """``steps`` ring steps of ``message`` bytes on a group of ``ranks`` ranks with
        ``per_node`` of them on each node (consecutive ranks: one stream crosses each node
        link; every intra-node edge runs beside it)."""
        if ranks <= 1:
            return 0.0
        if ranks > per_node:  # crosses nodes: the node link is the slowest edge
            hop = self._hop(True)
            seconds = message / hop.bandwidth
            if per_node > 1:
                seconds = max(seconds, message / self._hop(False).bandwidth)
            return steps * (seconds + hop.latency)
        hop = self._hop(False)
        return steps * (message / hop.bandwidth + hop.latency)

    def all_to_all(self, row: float, ranks: int, per_node: int, streams: int = 1) -> float:
        """Direct all-to-all of ``row`` bytes to each peer; ``streams`` such groups share
        each node link at once."""
        if ranks <= 1:
            return 0.0
        if ranks > per_node:
            hop = self._hop(True)
            link = streams * per_node * (ranks - per_node) * row / hop.bandwidth
            inside = (per_node - 1) * row / self._hop(False).bandwidth if per_node > 1 else 0.0
            return max(link, inside) + hop.latency
        hop = self._hop(False)
        return (ranks - 1) * row / hop.bandwidth + hop.latency


def _shard(numel: int, ranks: int) -> int:
    return -(-numel // ranks)


def predict(
    candidate: Candidate,
    layout: Layout,
    m: Measurements,
    units: Sequence[Sequence[int]],
    *,
    root: int | None = 0,
) -> Prediction:
    """Seconds per step of ``candidate``: ``units`` lists each FSDP unit's parameter sizes
    (elements); unit ``root`` (None: none) stays unsharded after forward, so it is gathered
    once per step, the others twice (forward and backward)."""
    net, lay, pred = _Net(layout, m), layout, Prediction(candidate)
    w, k = lay.shard, min(lay.node_size, lay.shard)
    codec = m.codecs
    for index, params in enumerate(units):
        params = [p for p in params if p > 0]
        if not params:
            continue
        # FSDP pads each parameter to a multiple of the shard group, and a weight codec
        # encodes each parameter's shard on its own (no group straddles two parameters)
        shards = [_shard(p, w) for p in params]
        s = sum(shards)
        gathers = 1 if index == root else 2
        weight_wire = lay.weight_wire(candidate.weights, shards)
        weight_codec = weight_codec_name(candidate.weights)
        for g in range(gathers):
            backward = g == 1
            if backward and candidate.hpz:  # inside the node, the forward's values, unquantised
                node_part = _shard(s * w, k) * lay.param_bytes
                pred.add("weights_intra", net.ring(k - 1, node_part, k, k))
                continue
            forward_only = candidate.weights.endswith(FORWARD_ONLY)
            quantised = candidate.weights != STOCK and not (forward_only and backward)
            if quantised and weight_wire.compressed:
                pred.add("weights", net.ring(w - 1, weight_wire.payload_bytes, w, k))
                pred.add(
                    "weights_codec",
                    codec[f"{weight_codec}_encode"].seconds(s, len(params))
                    + codec[f"{weight_codec}_decode"].seconds(s * w, len(params)),
                )
            else:
                pred.add("weights", net.ring(w - 1, weight_wire.plain_bytes, w, k))
        _gradients(pred, net, lay, codec, candidate, s)
    return pred


def _gradients(pred, net, lay: Layout, codec, candidate: Candidate, s: int) -> None:
    """One unit's gradient reduce-scatter (shard ``s`` per rank) and HSDP all-reduce."""
    w, k = lay.shard, min(lay.node_size, lay.shard)
    nodes = max(1, w // k)
    g = candidate.gradients
    compressed = g != STOCK and lay.grad_wire(g, s).compressed
    if compressed:
        encode, decode = codec[f"{g}_encode"], codec[f"{g}_decode"]
        payload = lay.grad_wire(g, s).payload_bytes
    if not compressed or w == 1:
        # gloo reduces and scatters by a ring all-reduce of the whole input
        pred.add("grads", net.ring(2 * (w - 1), s * FP32, w, k))
    elif candidate.hierarchical and nodes > 1:
        # one fp32 reduce-scatter per node block inside the node, then the codec across nodes
        pred.add("grads_intra", nodes * net.ring(2 * (k - 1), s * FP32, k, k))
        pred.add("grads", net.all_to_all(payload, nodes, 1, streams=k))
        pred.add("grads_codec", encode.seconds(nodes * s) + decode.seconds(nodes * s))
    else:
        pred.add("grads", net.all_to_all(payload, w, k))
        pred.add("grads_codec", encode.seconds(w * s) + decode.seconds(w * s))
    r = lay.replicas
    if r > 1:  # HSDP: replicas hold consecutive shard groups, so they sit on other nodes
        per_node = max(1, lay.node_size // w)
        part = _shard(s, r)
        if compressed and lay.grad_wire(g, part).compressed:
            # the hook: an encoded reduce-scatter, then an encoded all-gather of the reduced part
            partial = lay.grad_wire(g, part).payload_bytes
            pred.add("all_reduce", net.all_to_all(partial, r, per_node))
            pred.add("all_reduce", net.ring(r - 1, partial, r, per_node))
            pred.add(
                "all_reduce_codec",
                encode.seconds(s) + decode.seconds(s) + encode.seconds(part),
            )
        else:
            pred.add("all_reduce", net.ring(2 * (r - 1), part * FP32, r, per_node))
