"""Gradient fidelity of compressed reduce-scatters: what they deliver beside the exact mean.

Training losses at this scale are dominated by trajectory noise, so the primary measure of
error feedback is the gradient itself. :class:`ShadowReduceScatter` sits on an FSDP unit and
reduces every input three ways: the exact fp32 reduce-scatter, plain 4-bit (q4) and 4-bit
LoCo. It hands one of them to FSDP (the method whose trajectory is being followed) and gives
all of them to a :class:`FidelityTracker`, which keeps per-step scalars: the error of each
step's gradient and of the running sums, which is what the optimizer integrates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; 2.11 has only the old name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The three sums kept per method and step: the step's gradient, the running sum since step 0,
# and the sum over the current window of ``window`` steps.
KINDS = ("step", "cumulative", "window")
# Per kind, the partial sums that make the metrics: |d - g|^2, |g|^2, <d, g>, |d|^2.
ERR2, REF2, DOT, OUT2 = range(4)


def relative_error(err2: float, ref2: float) -> float:
    """``|d - g| / |g|`` from the squared norms (nan when the reference is 0)."""
    return math.sqrt(err2 / ref2) if ref2 > 0 else math.nan


def cosine(dot: float, out2: float, ref2: float) -> float:
    """``<d, g> / (|d| |g|)`` (nan when either is 0)."""
    return dot / math.sqrt(out2 * ref2) if out2 > 0 and ref2 > 0 else math.nan


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Sample mean and its standard error ``s / sqrt(n)`` (stderr nan for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("values must hold at least one number, got none")
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


class FidelityTracker:
    """Per-step partial sums of how far each method's output lies from the exact mean.

    Every FSDP unit reduces once per step, so a unit's k-th call belongs to step k. The
    partial sums of one rank's shards add up over ranks to the global ones
    (:meth:`all_reduce`); nothing is stored per step beyond a few scalars.
    """

    def __init__(self, methods: Sequence[str], steps: int, window: int = 50):
        if steps < 1 or window < 1:
            raise ValueError(f"steps and window must be >= 1, got {steps} and {window}")
        self.methods = tuple(methods)
        self.steps = steps
        self.window = window
        # [method, kind, step, partial sum], fp64
        self.sums = torch.zeros(len(self.methods), len(KINDS), steps, 4, dtype=torch.float64)
        self._units: dict[object, dict] = {}

    def add(self, unit: object, exact: torch.Tensor, outputs: Mapping[str, torch.Tensor]) -> None:
        """Record one reduction of ``unit``: the exact result and each method's output."""
        state = self._units.get(unit)
        if state is None:
            zeros = torch.zeros(exact.numel(), dtype=torch.float64)
            state = {
                "calls": 0,
                "cum_ref": zeros.clone(),
                "win_ref": zeros.clone(),
                "cum": {m: zeros.clone() for m in self.methods},
                "win": {m: zeros.clone() for m in self.methods},
            }
            self._units[unit] = state
        step = state["calls"]
        if step >= self.steps:
            raise RuntimeError(f"unit reduced more than steps={self.steps} times")
        ref = exact.detach().reshape(-1).double().cpu()
        if step % self.window == 0:
            state["win_ref"].zero_()
            for m in self.methods:
                state["win"][m].zero_()
        state["cum_ref"] += ref
        state["win_ref"] += ref
        for i, m in enumerate(self.methods):
            out = outputs[m].detach().reshape(-1).double().cpu()
            state["cum"][m] += out
            state["win"][m] += out
            pairs = (
                (out, ref),
                (state["cum"][m], state["cum_ref"]),
                (state["win"][m], state["win_ref"]),
            )
            for k, (d, g) in enumerate(pairs):
                self.sums[i, k, step] += torch.stack(
                    [(d - g).square().sum(), g.square().sum(), (d * g).sum(), d.square().sum()]
                )
        state["calls"] += 1

    def all_reduce(self, group: dist.ProcessGroup | None = None) -> None:
        """Sum the partial sums over the ranks, whose shards make up the whole gradient."""
        dist.all_reduce(self.sums, group=group)

    def curves(self, method: str, kind: str) -> dict[str, list[float]]:
        """Relative error and cosine similarity at every step."""
        s = self.sums[self.methods.index(method), KINDS.index(kind)].tolist()
        return {
            "rel_err": [relative_error(r[ERR2], r[REF2]) for r in s],
            "cosine": [cosine(r[DOT], r[OUT2], r[REF2]) for r in s],
        }

    def summary(self, method: str) -> dict[str, float]:
        """Mean per-step error and cosine; running-sum error over the first ``window`` steps,
        over all steps, and averaged over the complete windows."""
        step = self.curves(method, "step")
        cum = self.curves(method, "cumulative")
        win = self.curves(method, "window")
        ends = list(range(self.window - 1, self.steps, self.window))
        out = {
            "step_rel_err": _mean(step["rel_err"]),
            "step_cosine": _mean(step["cosine"]),
            f"running_sum_{self.steps}_rel_err": cum["rel_err"][-1],
            f"running_sum_{self.steps}_cosine": cum["cosine"][-1],
        }
        if ends:
            out[f"running_sum_{self.window}_rel_err"] = _mean([win["rel_err"][t] for t in ends])
            out[f"running_sum_{self.window}_cosine"] = _mean([win["cosine"][t] for t in ends])
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class ShadowReduceScatter:
    """Reduce one unit's gradients exactly and with every comm of ``comms``; deliver one.

    A custom reduce-scatter for ``FSDPModule.set_custom_reduce_scatter`` (FSDP2 calls its
    ``allocate`` and ``__call__``); ``comms`` are the ones ``CommHandle.reduce_scatters``
    lists for this unit, one per registered codec.

    ``deliver`` names the comm whose output FSDP receives (``"exact"`` for the fp32
    reduce-scatter), so training follows that method's trajectory while every method is
    measured on the very same input.
    """

    def __init__(
        self,
        comms: Mapping[str, Callable[..., object]],
        deliver: str,
        tracker: FidelityTracker,
        unit: object,
    ):
        if deliver != "exact" and deliver not in comms:
            raise ValueError(f"deliver must be 'exact' or one of {sorted(comms)}, got {deliver!r}")
        self.comms = dict(comms)
        self.deliver = deliver
        self.tracker = tracker
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        exact = torch.empty_like(output_tensor)
        _reduce_scatter(exact, input_tensor.clone(), op=op, group=group)
        outputs = {}
        for name, comm in self.comms.items():
            outputs[name] = torch.empty_like(output_tensor)
            comm(output_tensor=outputs[name], input_tensor=input_tensor.clone(), group=group, op=op)
        self.tracker.add(self.unit, exact, outputs)
        output_tensor.copy_(exact if self.deliver == "exact" else outputs[self.deliver])
        return None
