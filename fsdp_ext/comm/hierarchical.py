"""Node groups for hierarchical mode: full precision inside a node, 4-bit LoCo across nodes.

Global rank ``g`` sits on node ``g // node_size``. A shard group (any set of ranks: the whole
job, HSDP's shard dim, the experts' efsdp mesh, a pipeline stage's dp mesh) is cut by node;
every node must hold the same number ``k`` of its ranks. The intra-node group holds this
rank's ``k`` peers on its node; the inter-node group holds the ``N`` ranks of the shard group
with this rank's local index, one per node. A shard group inside one node has ``N = 1`` and
sends full precision only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_ext._torch import reduce_scatter_into


@dataclass(frozen=True)
class NodeGroups:
    intra_node: dist.ProcessGroup
    inter_node: dist.ProcessGroup | None
    node_size: int
    num_nodes: int
    order: tuple[int, ...]  # group indices of the destinations, by (local index, node)
    _indices: dict = field(default_factory=dict, compare=False, repr=False)

    def index(self, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``rows`` as an index tensor on ``device``, built once: a tensor made from a
        Python list is a synchronous host-to-device copy on CUDA, so the reduction reuses it
        every step instead."""
        key = (rows, torch.device(device))
        if key not in self._indices:
            self._indices[key] = torch.tensor(rows, dtype=torch.int64, device=device)
        return self._indices[key]

    def node_members(self, node: int) -> tuple[int, ...]:
        """Group indices of the ranks whose chunks node ``node``'s rank of this local index
        receives, in local-index order."""
        k, n = self.node_size, self.num_nodes
        return tuple(self.order[local * n + node] for local in range(k))


def plan_nodes(ranks: list[int], node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node rank lists by node, inter-node rank lists by local index) of a group."""
    nodes: dict[int, list[int]] = {}
    for g in ranks:
        nodes.setdefault(g // node_size, []).append(g)
    counts = {len(v) for v in nodes.values()}
    if len(counts) != 1:
        per_node = {n: len(v) for n, v in sorted(nodes.items())}
        raise ValueError(
            f"node_size={node_size} puts {per_node} ranks of the shard group {ranks} on "
            "each node; every node must hold the same number of them"
        )
    k = counts.pop()
    intra = [sorted(v) for _, v in sorted(nodes.items())]
    inter = [[node[j] for node in intra] for j in range(k)]
    return intra, inter


def build_node_groups(groups: list[list[int]], node_size: int) -> dict[tuple[int, ...], NodeGroups]:
    """Subgroups of every shard group in ``groups`` (their ranks, in group order).

    ``dist.new_group`` is collective over the default group, so every rank must call this
    with the same ``groups`` (see :func:`all_shard_groups`). Returns the groups this rank is in.
    """
    me = dist.get_rank()
    out: dict[tuple[int, ...], NodeGroups] = {}
    for ranks in sorted({tuple(g) for g in groups}):
        intra, inter = plan_nodes(list(ranks), node_size)
        mine_intra = mine_inter = None
        for members in intra:
            pg = dist.new_group(members)
            if me in members:
                mine_intra = pg
        for members in inter:
            pg = dist.new_group(members) if len(intra) > 1 else None
            if me in members:
                mine_inter = pg
        if me not in ranks:
            continue
        k, n = len(inter), len(intra)
        order = tuple(ranks.index(intra[node][local]) for local in range(k) for node in range(n))
        out[ranks] = NodeGroups(mine_intra, mine_inter, k, n, order)
    return out


def all_shard_groups(mine: list[list[int]]) -> list[list[int]]:
    """The union over every rank of the shard groups each rank needs (one collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [list(g) for g in mine])
    return [g for per_rank in gathered for g in per_rank]


def node_local_reduce_scatter(
    input_tensor: torch.Tensor, groups: NodeGroups
) -> tuple[torch.Tensor, int]:
    """Sum, inside the node, the ``N`` chunks bound for this rank's local index.

    ``input_tensor`` is rank-major ``[W * S]``. Returns ``[N, S]`` (row ``n`` is the node
    sum of the chunk bound for node ``n``'s rank with this local index, still to be reduced
    across nodes) and the bytes sent.
    """
    k, n = groups.node_size, groups.num_nodes
    rows = input_tensor.view(n * k, -1)
    if k == 1:
        if groups.order == tuple(range(n)):
            return rows, 0
        return rows.index_select(0, groups.index(groups.order, rows.device)), 0
    partial = rows.new_empty(n, rows.shape[1])
    # one reduce-scatter per node block; a block whose ranks sit contiguously in the group
    # (the usual case) is read in place, with no gathered copy
    for node in range(n):
        members = groups.node_members(node)
        if members == tuple(range(members[0], members[0] + k)):
            block = rows[members[0] : members[0] + k]
        else:
            block = rows.index_select(0, groups.index(members, rows.device))
        reduce_scatter_into(
            output=partial[node],
            input=block.reshape(-1),
            op=dist.ReduceOp.SUM,
            group=groups.intra_node,
        )
    return partial, (k - 1) * partial.numel() * partial.element_size()
