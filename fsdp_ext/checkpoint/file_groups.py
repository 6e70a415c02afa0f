"""Which items go in which file: runs of whole layers per rank, shared by the POSIX and the
blob writers.

Every file costs an open (or a request), a zip header and an fsync; one file per layer would
make a small model's save slower than stock's one file per rank. So files hold runs of whole
layers, in layer order, of at least ``min_file_bytes`` each; then the largest file is halved
until each of the ``thread_count`` writer threads has one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from fsdp_ext.checkpoint.layers import LayerKey, layer_of
from fsdp_ext.checkpoint.planner import item_nbytes

__all__ = ["group_items", "safe_name", "split_results"]

OTHER = "other"


def group_items(
    plan: SavePlan, layer_key: LayerKey | None, min_file_bytes: int, thread_count: int
) -> list[tuple[str, list[WriteItem]]]:
    """(group name, items) per file of one rank's plan (see the module docstring)."""
    groups: dict[str, list] = defaultdict(list)
    for item in plan.items:
        groups[layer_of(layer_key, item.index.fqn) or OTHER].append(item)
    bins: list[tuple[str, list]] = []
    run_names: list[str] = []
    for name in sorted(groups, key=_natural):
        if run_names and sum(item_nbytes(i) for i in bins[-1][1]) < min_file_bytes:
            run_names.append(name)
            bins[-1] = (f"{run_names[0]}..{name}", bins[-1][1] + groups[name])
        else:
            run_names = [name]
            bins.append((name, list(groups[name])))
    while len(bins) < thread_count:
        name, items = max(
            bins, key=lambda b: (sum(item_nbytes(i) for i in b[1]), b[0]), default=(None, [])
        )
        if len(items) < 2:
            break
        halves: tuple[list, list] = ([], [])
        sizes = [0, 0]
        for item in sorted(items, key=lambda i: -item_nbytes(i)):
            k = 0 if sizes[0] <= sizes[1] else 1
            halves[k].append(item)
            sizes[k] += item_nbytes(item)
        bins.remove((name, items))
        bins += [(f"{name}-a", halves[0]), (f"{name}-b", halves[1])]
    return bins


def _natural(name: str) -> tuple:
    """ "other" first, then layers by number: layers.2 before layers.10."""
    head, _, tail = name.rpartition(".")
    return (name != OTHER, head, int(tail) if tail.isdigit() else -1, name)


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def split_results(
    results: list[list[WriteResult]], file_prefix: str
) -> tuple[dict[str, Any], dict[Any, Any]]:
    """Every rank's write results, split into the per-file records a writer smuggles through
    DCP under ``file_prefix`` (by file name) and the items' own storage data (by index)."""
    records: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    for rank_results in results:
        for wr in rank_results:
            if wr.index.fqn.startswith(file_prefix):
                records[wr.storage_data.name] = wr.storage_data
            else:
                storage_data[wr.index] = wr.storage_data
    return records, storage_data
