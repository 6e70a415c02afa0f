"""``auto_config``: measure, predict every candidate, decide on rank 0, broadcast.

Every rank measures (:func:`~fsdp_ext.comm.auto.measure.measure`); rank 0 gathers the
measurements, takes the slowest of each (a step waits for its slowest rank), predicts every
candidate the user's fixed choices leave open (:mod:`fsdp_ext.comm.auto.cost`), picks one
and broadcasts it, so every rank installs the same collectives even where its own
measurements differ. Among the candidates within ``tolerance`` of the fastest prediction the
one that quantises least wins: the model is a few percent from the truth at best, and full
precision costs nothing in quality.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_ext.comm.auto.cost import (
    Candidate,
    CodecSpeed,
    Hop,
    Layout,
    Measurements,
    Prediction,
    candidates,
    predict,
)
from fsdp_ext.comm.auto.measure import measure
from fsdp_ext.comm.registry import gradient_names, weight_names
from fsdp_ext.comm.zeropp import CommConfig

__all__ = ["AutoDecision", "auto_config", "choose", "pick", "slowest"]

COLUMNS = ("weights", "weights_intra", "weights_codec", "grads", "grads_intra", "grads_codec")


@dataclass
class AutoDecision:
    """The choice of :func:`auto_config`, the same on every rank, and why.

    ``comm_config()`` is the whole choice as the one ``CommConfig`` that everything
    downstream takes: ``fsdp_ext.comm.enable(model, ...)``, and whoever shards (hpZ:
    ``comm_config().hpz`` with ``node_local_reshard(mesh, comm_config().node_size)``).
    """

    choice: Candidate
    layout: Layout
    measurements: Measurements
    predictions: list[Prediction] = field(default_factory=list)
    fixed: dict[str, object] = field(default_factory=dict)
    tolerance: float = 0.05

    def comm_config(self) -> CommConfig:
        """The whole choice, in the same names, at the layout's group sizes and node size."""
        c, lay = self.choice, self.layout
        return CommConfig(
            gradients=lay.gradient_config(c.gradients),
            weights=lay.weight_config(c.weights),
            hpz=c.hpz,
            hierarchical=c.hierarchical,
            node_size=lay.node_size,
        )

    def predicted_ms(self, candidate: Candidate | None = None) -> float:
        candidate = candidate or self.choice
        return next(p.total for p in self.predictions if p.candidate == candidate) * 1e3

    def summary(self) -> str:
        """One line: the choice, its prediction, how long measuring took."""
        return (
            f"comm auto: {self.choice.name} (predicted {self.predicted_ms():.1f} ms of "
            f"communication per step; probe {self.measurements.probe_s:.2f} s; --explain says why)"
        )

    def explain(self) -> str:
        """The measurements, every candidate's predicted ms per step, and the choice."""
        lay, m = self.layout, self.measurements
        lines = [
            f"comm auto: {lay.world} ranks, {lay.node_size} per node, {lay.nodes} node"
            + ("s" if lay.nodes > 1 else "")
            + (f", {lay.replicas} HSDP replicas" if lay.replicas > 1 else "")
            + f", parameters {lay.param_bytes * 8}-bit on the wire; probe {m.probe_s:.2f} s",
        ]
        for name, hop in (("inter-node link", m.inter), ("intra-node", m.intra)):
            if hop is not None:
                lines.append(
                    f"  {name}: {hop.bandwidth / 1e6:9.1f} MB/s, {hop.latency * 1e3:.3f} ms "
                    "per message (slowest rank)"
                )
        lines.append(
            "  codecs (ns per element + us per call): "
            + ", ".join(
                f"{k} {s.per_element * 1e9:.1f}+{s.per_call * 1e6:.0f}" for k, s in m.codecs.items()
            )
        )
        if self.fixed:
            lines.append(
                "  fixed by the user: " + ", ".join(f"{k}={v}" for k, v in self.fixed.items())
            )
        lines.append(
            "predicted ms per step of communication and codecs (compute, the same for all, "
            "left out):"
        )
        head = f"  {'candidate':40}" + "".join(f"{c:>14}" for c in COLUMNS) + f"{'total':>9}"
        lines.append(head)
        best = min(p.total for p in self.predictions)
        for p in sorted(self.predictions, key=lambda p: (p.total, p.candidate.lossy_parts)):
            mark = "->" if p.candidate == self.choice else "  "
            cells = "".join(f"{p.seconds.get(c, 0.0) * 1e3:14.1f}" for c in COLUMNS)
            lines.append(f"{mark}{p.candidate.name:40}{cells}{p.total * 1e3:9.1f}")
        lines.append(
            f"chosen: {self.choice.name} ({self.predicted_ms():.1f} ms; the fastest predicts "
            f"{best * 1e3:.1f} ms; within {self.tolerance:.0%} of it the least quantised wins)"
        )
        return "\n".join(lines)


def slowest(views: Sequence[Measurements]) -> Measurements:
    """Every rank's measurements combined: the lowest bandwidth, the highest latency and
    codec times of any rank (a step runs at its slowest rank's pace)."""

    def hop(hops: list[Hop | None]) -> Hop | None:
        hops = [h for h in hops if h is not None]
        if not hops:
            return None
        return Hop(min(h.bandwidth for h in hops), max(h.latency for h in hops))

    codecs = {
        key: CodecSpeed(
            max(v.codecs[key].per_call for v in views),
            max(v.codecs[key].per_element for v in views),
        )
        for key in views[0].codecs
    }
    return Measurements(
        hop([v.intra for v in views]),
        hop([v.inter for v in views]),
        codecs,
        probe_s=max(v.probe_s for v in views),
    )


def choose(
    layout: Layout,
    measurements: Measurements,
    units: Sequence[Sequence[int]],
    *,
    root: int | None = 0,
    fixed: dict[str, object] | None = None,
    tolerance: float = 0.05,
) -> AutoDecision:
    """The decision on one set of measurements (pure: no communication)."""
    fixed = dict(fixed or {})
    allowed = [c for c in candidates(layout) if all(getattr(c, k) == v for k, v in fixed.items())]
    if not allowed:
        raise ValueError(
            f"no candidate has {fixed} on {layout.world} ranks with {layout.node_size} per node: "
            "hpZ and hierarchical gradients need ranks on more than one node, and more than "
            "one rank per node"
        )
    predictions = [predict(c, layout, measurements, units, root=root) for c in allowed]
    chosen = pick(predictions, tolerance)
    return AutoDecision(chosen, layout, measurements, predictions, fixed, tolerance)


def pick(predictions: Sequence[Prediction], tolerance: float) -> Candidate:
    """The rule on predicted totals alone (pure, so tests can feed it exact near-ties).

    ``tolerance`` is relative to the fastest total, so the rule reads the same on a 1 ms
    and a 100 s step; within it the least quantised candidate wins (the model is a few
    percent from the truth at best), then the faster of equally quantised ones.
    """
    if not predictions:
        raise ValueError("pick: predictions must not be empty")
    best = min(p.total for p in predictions)
    near = [p for p in predictions if p.total <= best * (1 + tolerance)]
    return min(near, key=lambda p: (p.candidate.lossy_parts, p.total)).candidate


def _check_fixed(fixed: dict[str, object]) -> None:
    allowed = {"weights": weight_names(), "gradients": gradient_names(), "hpz": (True, False)}
    allowed["hierarchical"] = (True, False)
    for key, value in fixed.items():
        flag = key in ("hpz", "hierarchical")
        if isinstance(value, bool) != flag or value not in allowed[key]:
            raise ValueError(f"auto_config: {key} must be one of {allowed[key]}, got {value!r}")


def auto_config(
    units: Sequence[Sequence[int]],
    *,
    node_size: int,
    replicas: int = 1,
    param_dtype: torch.dtype = torch.float32,
    root: int | None = 0,
    weights: str | None = None,
    hpz: bool | None = None,
    gradients: str | None = None,
    hierarchical: bool | None = None,
    tolerance: float = 0.05,
    grad_group_size: int = 128,
    weight_group_size: int = 256,
    measurements: Measurements | None = None,
) -> AutoDecision:
    """Pick the fastest communication for this job; collective over the default group.

    ``units``: each FSDP unit's parameter sizes in elements (:func:`unit_sizes` gives them from
    a wrap plan), unit ``root`` gathered once per step; ``node_size``: ranks per node
    (consecutive ranks); ``replicas``: HSDP replicas. ``weights`` / ``hpz`` / ``gradients`` /
    ``hierarchical`` fix that part of the choice (None: choose it); the user's flags win.
    ``measurements``: this rank's, instead of measuring (tests). Rank 0 decides from every
    rank's measurements and broadcasts, so the decision is the same on every rank.
    """
    fixed = {
        k: v
        for k, v in {
            "weights": weights,
            "hpz": hpz,
            "gradients": gradients,
            "hierarchical": hierarchical,
        }.items()
        if v is not None
    }
    _check_fixed(fixed)
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {param_dtype}")
    world = dist.get_world_size()
    layout = Layout(
        world,
        node_size,
        replicas,
        param_bytes=torch.empty((), dtype=param_dtype).element_size(),
        grad_group_size=grad_group_size,
        weight_group_size=weight_group_size,
    )
    mine = measurements if measurements is not None else measure(node_size)
    views: list = [None] * world
    dist.all_gather_object(views, mine)
    decision: list = [None]
    if dist.get_rank() == 0:
        try:
            decision[0] = choose(
                layout, slowest(views), units, root=root, fixed=fixed, tolerance=tolerance
            )
        except ValueError as exc:  # every rank raises it, none waits for a decision
            decision[0] = exc
    dist.broadcast_object_list(decision, src=0)
    if isinstance(decision[0], Exception):
        raise ValueError(str(decision[0]))
    return decision[0]
