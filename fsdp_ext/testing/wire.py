"""The one count of what a rank puts on the wire, used by every benchmark and test.

:class:`WireCounter` wraps ``torch.distributed``'s collectives for as long as it is open and,
for each call (the outermost only: one collective may call another), works out from the
tensors handed to it which peers get how many bytes, by one formula per collective
(:func:`sent_bytes`, ``b`` the bytes of this rank's input, ``W`` the group's ranks):

- all-gather: ``(W - 1) b``, in a ring (all to the next rank);
- reduce-scatter: ``(W - 1) / W b`` in a ring, or ``2 (W - 1) / W b`` with
  ``gloo_algorithms`` (gloo reduces and scatters through a ring all-reduce of the input);
- all-reduce: ``2 (W - 1) / W b``, in a ring;
- all-to-all: each destination's rows, directly (its own stay);
- broadcast: ``b`` from the source to every other rank, directly.

From the destinations it keeps, per kind of collective: the bytes sent to other ranks
(:attr:`WireCounter.sent`), to ranks on other nodes (:attr:`~WireCounter.cross`; nodes hold
``node_size`` consecutive ranks), and by the group's scope (:attr:`~WireCounter.by_scope`,
``"<kind>_intra"`` for a group inside one node, else ``"<kind>_inter"``).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["WireCounter", "sent_bytes"]

#: wrapped function -> kind of collective
COLLECTIVES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather_list",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}
RING_FACTORS = {  # bytes sent = numerator * (W - 1) * b // denominator
    "all_gather": (1, 1),
    "all_gather_list": (1, 1),
    "reduce_scatter": (1, 0),  # 0: divide by W
    "all_reduce": (2, 0),
}


def sent_bytes(kind: str, nbytes: int, world: int, *, gloo_algorithms: bool = False) -> int:
    """Bytes one rank sends to its peers in a ring collective of ``kind`` over ``world``
    ranks with ``nbytes`` of input (see the module docstring)."""
    if kind not in RING_FACTORS:
        raise ValueError(f"kind must be one of {sorted(RING_FACTORS)}, got {kind!r}")
    factor, per_rank = RING_FACTORS[kind]
    if kind == "reduce_scatter" and gloo_algorithms:
        factor = 2
    return factor * (world - 1) * nbytes // (per_rank or world)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class WireCounter:
    """Count the bytes this rank's collectives send, while open (``with WireCounter():``,
    or :meth:`open` for the whole process). ``paused`` skips calls (warm-up, validation)."""

    def __init__(self, node_size: int | None = None, *, gloo_algorithms: bool = False):
        if node_size is not None and (not isinstance(node_size, int) or node_size < 1):
            raise ValueError(f"node_size must be None or an int >= 1, got {node_size!r}")
        self.node_size = node_size
        self.gloo_algorithms = gloo_algorithms
        self.paused = False
        self.sent: dict[str, int] = {}
        self.cross: dict[str, int] = {}
        self.by_scope: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._originals: list[tuple[object, str, Callable]] = []
        self._depth = threading.local()

    def total(self, *kinds: str) -> int:
        """Bytes sent to other ranks by collectives of ``kinds`` (every kind when none)."""
        return sum(v for k, v in self.sent.items() if not kinds or k in kinds)

    def open(self) -> WireCounter:
        """Wrap the collectives (before anything binds them by name)."""
        if self._originals:
            raise RuntimeError("this WireCounter is open already")
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            counted = self._wrap(name, original)
            for owner in (c10d, dist):
                self._originals.append((owner, name, getattr(owner, name)))
                setattr(owner, name, counted)
        return self

    def close(self) -> None:
        """Give back the original collectives."""
        for owner, name, fn in reversed(self._originals):
            setattr(owner, name, fn)
        self._originals = []

    def __enter__(self) -> WireCounter:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wrap(self, name: str, original: Callable) -> Callable:
        rule = getattr(self, f"_{name}")
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and not self.paused:
                call = signature.bind(*args, **kwargs).arguments
                group = call.get("group")
                ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
                self._add(COLLECTIVES[name], ranks, rule(ranks, call))
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def _add(self, kind: str, ranks: list[int], to: dict[int, int]) -> None:
        me = dist.get_rank()
        sent = sum(b for r, b in to.items() if r != me)
        self.sent[kind] = self.sent.get(kind, 0) + sent
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if self.node_size is None:
            return
        node = me // self.node_size
        cross = sum(b for r, b in to.items() if r // self.node_size != node)
        self.cross[kind] = self.cross.get(kind, 0) + cross
        spans = len({r // self.node_size for r in ranks}) > 1
        key = f"{kind}_{'inter' if spans else 'intra'}"
        self.by_scope[key] = self.by_scope.get(key, 0) + sent

    # ---- one rule per collective: {destination rank: bytes} of one call, from its arguments

    def _ring(self, ranks: list[int], kind: str, nbytes: int) -> dict[int, int]:
        successor = ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]
        gloo = self.gloo_algorithms
        return {successor: sent_bytes(kind, nbytes, len(ranks), gloo_algorithms=gloo)}

    def _all_gather_single(self, ranks: list[int], call: dict) -> dict[int, int]:
        return self._ring(ranks, "all_gather", _nbytes(call["input_tensor"]))

    _all_gather_into_tensor = _all_gather_single

    def _all_gather(self, ranks: list[int], call: dict) -> dict[int, int]:
        return self._ring(ranks, "all_gather_list", _nbytes(call["tensor"]))

    def _reduce_scatter_single(self, ranks: list[int], call: dict) -> dict[int, int]:
        return self._ring(ranks, "reduce_scatter", _nbytes(call["input"]))

    _reduce_scatter_tensor = _reduce_scatter_single

    def _all_reduce(self, ranks: list[int], call: dict) -> dict[int, int]:
        return self._ring(ranks, "all_reduce", _nbytes(call["tensor"]))

    def _all_to_all_single(self, ranks: list[int], call: dict) -> dict[int, int]:
        tensor = call["input"]
        rows = tensor.shape[0] if tensor.dim() else 1
        row = _nbytes(tensor) // max(1, rows)
        splits = call.get("input_split_sizes") or [rows // len(ranks)] * len(ranks)
        return {r: s * row for r, s in zip(ranks, splits, strict=True)}

    def _broadcast(self, ranks: list[int], call: dict) -> dict[int, int]:
        src = call.get("src")
        if src is None and call.get("group_src") is not None:
            src = ranks[call["group_src"]]
        if src != dist.get_rank():
            return {}
        return dict.fromkeys(ranks, _nbytes(call["tensor"]))
