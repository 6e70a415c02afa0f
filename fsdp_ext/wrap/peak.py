"""Peak unsharded bytes of a wrap plan: FSDP2's gather/free schedule replayed on paper.

What is counted is what FSDP2 holds beyond the sharded state: each unit's unsharded
parameters while it is gathered, its residual post-forward shards with an int
``reshard_after_forward``, and the unsharded gradients from when autograd writes them
until the unit's reduce-scatter. The schedule follows torch 2.13's ``_fsdp_state`` and
``_fsdp_param_group``:

* forward: a unit is gathered at its first member's pre-forward (and ``forward_prefetch``
  units ahead of it), freed at its last member's post-forward unless
  ``reshard_after_forward`` is False (kept) or an int ``r`` (hpZ: kept at 1/r of its
  dim-0-padded size, until its backward gather frees it);
* backward: a unit is gathered when the gradient reaches its output, and prefetches the
  ``backward_prefetch`` units before it in post-forward order (the implicit default is
  1); its gradients appear as backward passes its modules and are freed with its
  parameters at its post-backward, which runs when the gradient reaches its input;
* the root is the unit gathered first and freed last; FSDP2 keeps it gathered through
  the step unless ``reshard_after_forward`` was passed explicitly, and parameters
  folded into it hold their gradients until backward ends.

Forward order is module pre-order, which is how models are written; a model whose
forward calls modules out of that order can differ (docs/wrap.md, limits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitSpan:
    """One unit on the forward timeline (module pre-order positions, inclusive).

    ``grads``: (position, bytes) of the gradients of the parameters the unit manages,
    at the module that owns them. ``reshard_after_forward``: True, False, or an int r.
    ``padded_bytes``: ``param_bytes`` with each parameter's dim 0 padded to a multiple of
    the world size (None: no padding), which is what an int r keeps ``1/r`` of.
    """

    name: str
    param_bytes: int
    start: int
    end: int
    grads: tuple[tuple[int, int], ...]
    reshard_after_forward: bool | int = True
    padded_bytes: int | None = None


@dataclass(frozen=True)
class PeakEstimate:
    bytes: int
    phase: str  # "forward" or "backward"
    at_unit: str  # the unit running when the peak is reached


def _post_forward_bytes(span: UnitSpan) -> int:
    raf = span.reshard_after_forward
    if raf is False:
        return span.param_bytes
    if raf is True:
        return 0
    padded = span.param_bytes if span.padded_bytes is None else span.padded_bytes
    return -(-padded // int(raf))


def estimate_peak(
    spans: list[UnitSpan], *, forward_prefetch: int = 0, backward_prefetch: int = 1
) -> PeakEstimate:
    """Largest sum of live unsharded parameter and gradient bytes over one step.

    ``spans[0]`` is the root, gathered first and freed last.
    """
    if forward_prefetch < 0 or backward_prefetch < 0:
        raise ValueError(
            f"prefetch depths must be >= 0, got forward_prefetch={forward_prefetch}, "
            f"backward_prefetch={backward_prefetch}"
        )
    n = len(spans)
    kept = [_post_forward_bytes(s) for s in spans]
    pre_order = sorted(range(n), key=lambda i: (spans[i].start, -spans[i].end, i))
    post_order = sorted(range(n), key=lambda i: (spans[i].end, -spans[i].start, -i))
    best = PeakEstimate(0, "forward", spans[0].name if spans else "")
    live: dict[int, int] = {}

    def sample(phase: str, unit: int, grads: int = 0) -> None:
        nonlocal best
        total = sum(live.values()) + grads
        if total > best.bytes:
            best = PeakEstimate(total, phase, spans[unit].name)

    # Forward: pre-forwards at a position before post-forwards there.
    events = [(spans[i].start, 0, k, i) for k, i in enumerate(pre_order)]
    events += [(spans[i].end, 1, k, i) for k, i in enumerate(post_order)]
    rank_in_pre = {i: k for k, i in enumerate(pre_order)}
    for _, kind, _, i in sorted(events):
        if kind == 0:
            live[i] = spans[i].param_bytes
            for j in pre_order[rank_in_pre[i] + 1 : rank_in_pre[i] + 1 + forward_prefetch]:
                live[j] = spans[j].param_bytes
            sample("forward", i)
        else:
            if kept[i]:
                live[i] = kept[i]
            else:
                live.pop(i, None)
    # Backward: the gradient reaches outputs (end) from the last position to the first.
    rank_in_post = {i: k for k, i in enumerate(post_order)}
    done: set[int] = set()
    grads = dict.fromkeys(range(n), 0)
    grad_at: list[dict[int, int]] = [{} for _ in range(n)]
    for i, span in enumerate(spans):
        for pos, nbytes in span.grads:
            grad_at[i][pos] = grad_at[i].get(pos, 0) + nbytes
    events = [(-spans[i].end, 0, spans[i].start, i) for i in range(n)]
    events += [(-pos, 1, 0, i) for i in range(n) for pos in grad_at[i]]
    events += [(-spans[i].start, 2, spans[i].end, i) for i in range(n)]
    for neg_pos, kind, _, i in sorted(events):
        if kind == 0:
            live[i] = spans[i].param_bytes
            k = rank_in_post[i]
            for j in reversed(post_order[max(0, k - backward_prefetch) : k]):
                if j not in done:
                    live[j] = spans[j].param_bytes
        elif kind == 1:
            grads[i] += grad_at[i][-neg_pos]
        else:
            sample("backward", i, sum(grads.values()))
            live.pop(i, None)
            grads[i] = 0
            done.add(i)
    return best
