"""Ranks per node, as the user gave it or as the launcher set it.

Hierarchical gradients (``comm``) and hpZ (``wrap``) both need it, so it lives outside both.
"""

from __future__ import annotations

import os

__all__ = ["launcher_node_size", "resolve_node_size"]


def launcher_node_size() -> int:
    """Ranks per node as the launcher set them (torchrun's ``LOCAL_WORLD_SIZE``)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or not local.isdigit() or int(local) < 1:
        raise ValueError(
            "node_size='auto' needs the launcher's LOCAL_WORLD_SIZE (torchrun sets it), "
            f"got {local!r}; pass node_size=<ranks per node> instead"
        )
    return int(local)


def resolve_node_size(node_size: int | str) -> int:
    """An int node size, or ``"auto"`` resolved from the launcher."""
    if node_size == "auto":
        return launcher_node_size()
    k = node_size
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"node_size must be 'auto' or an int >= 1, got {k!r}")
    return k
