"""hpZ: keep each unit's post-forward copy inside the node, so backward gathers stay there.

FSDP2 takes ``reshard_after_forward=r`` (an int): after forward a unit keeps ``1/r`` of
its unsharded parameters, and the backward all-gather runs over ``r`` ranks only. Those
``r`` ranks are consecutive entries of the unit's mesh (torch 2.11-2.15 builds the
post-forward mesh as ``mesh.mesh.view(-1, r)``, so under HSDP each block lies in one
replica's shard group), so the right ``r`` is the number of a shard group's ranks on one
node, and it is right only if every block of ``r`` consecutive mesh entries sits on one
node. That is what :func:`node_local_reshard` computes and checks.

Global rank ``g`` sits on node ``g // node_size`` (the launcher's numbering);
``"auto"`` reads the node size from torchrun's ``LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from fsdp_ext.node_size import resolve_node_size

__all__ = [
    "node_local_reshard",
    "node_reshard_for_ranks",
    "resolve_reshard_after_forward",
]

NODE = "node"


def node_reshard_for_ranks(
    ranks: Sequence[int], node_size: int, shard_size: int | None = None
) -> bool | int:
    """``reshard_after_forward`` for a unit whose flattened mesh holds ``ranks`` (mesh
    order, the shard dim last, ``shard_size`` entries long; default: all of them).

    Each run of ``shard_size`` entries is one shard group (an HSDP mesh has one per
    replica). ``r`` is the number of a shard group's ranks on one node, the same for every
    node and group, and every block of ``r`` consecutive entries must sit on one node. The
    replicas may sit on other nodes or on the same ones (a (2, 4) mesh of
    ``[[0, 2, 4, 6], [1, 3, 5, 7]]`` on nodes of 4 gives 2). ``True`` when each shard
    group lies inside one node (every gather stays there anyway), ``False`` when each node
    holds one rank of it (the node-local copy is the whole parameter).
    """
    ranks = list(ranks)
    shard_size = len(ranks) if shard_size is None else shard_size
    if shard_size < 1 or len(ranks) % shard_size:
        raise ValueError(
            f"reshard_after_forward='node': a shard dim of {shard_size} ranks does not cut "
            f"the mesh {ranks} into whole shard groups"
        )
    groups = [ranks[start : start + shard_size] for start in range(0, len(ranks), shard_size)]
    sizes: dict[int, list[int]] = {}
    for group in groups:
        per_node = Counter(g // node_size for g in group)
        counts = set(per_node.values())
        if len(counts) != 1:
            raise ValueError(
                f"reshard_after_forward='node' needs every node to hold as many of a shard "
                f"group's ranks; node size {node_size} puts {dict(sorted(per_node.items()))} "
                f"of shard group {group} on each node"
            )
        sizes.setdefault(counts.pop(), group)
    if len(sizes) != 1:
        raise ValueError(
            f"reshard_after_forward='node': the shard groups hold different numbers of ranks "
            f"per node (node size {node_size}: "
            + ", ".join(f"{g} has {r}" for r, g in sorted(sizes.items()))
            + "); FSDP takes one size for every group"
        )
    r = next(iter(sizes))
    for group in groups:
        for start in range(0, shard_size, r):
            block = group[start : start + r]
            if len({g // node_size for g in block}) != 1:
                raise ValueError(
                    f"reshard_after_forward='node': FSDP keeps the post-forward copy on blocks "
                    f"of {r} consecutive mesh entries, and {block} spans nodes (node size "
                    f"{node_size}, mesh {ranks}); order the mesh so each node's ranks are "
                    "adjacent"
                )
    if r == shard_size:
        return True
    return False if r == 1 else r


def node_local_reshard(
    mesh: DeviceMesh | None = None, node_size: int | str = "auto", world_size: int = 0
) -> bool | int:
    """The ``reshard_after_forward`` that makes a unit on ``mesh`` hpZ: post-forward copy
    and backward all-gather inside each node.

    ``mesh``: the unit's mesh (1-D, or 2-D HSDP with the shard dim last); ``None`` means
    ranks ``0 .. world_size - 1`` (a dry run). ``node_size``: ranks per node, or
    ``"auto"`` (the launcher's ``LOCAL_WORLD_SIZE``).
    """
    k = resolve_node_size(node_size)
    if mesh is not None:
        return node_reshard_for_ranks(mesh.mesh.flatten().tolist(), k, mesh.mesh.shape[-1])
    if world_size < 1:
        raise ValueError("node_local_reshard needs a mesh or a world_size >= 1")
    return node_reshard_for_ranks(range(world_size), k)


def resolve_reshard_after_forward(
    value: bool | int | str | None, mesh: DeviceMesh | None, world_size: int = 0
) -> bool | int | None:
    """``fully_shard``'s argument with ``"node"`` replaced by :func:`node_local_reshard`."""
    if value == NODE:
        return node_local_reshard(mesh, "auto", world_size)
    if isinstance(value, str):
        raise ValueError(
            f"reshard_after_forward must be a bool, an int, None or 'node', got {value!r}"
        )
    return value
