"""Node groups for hierarchical mode: full precision inside a node, 4-bit LoCo across nodes.

Rank ``r`` of a group of ``W = N * k`` ranks sits on node ``r // k`` at local index ``r % k``.
The intra-node group holds the ``k`` ranks of its node; the inter-node group holds the ``N``
ranks with its local index, one per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class NodeGroups:
    intra_node: dist.ProcessGroup
    inter_node: dist.ProcessGroup
    intra_node_size: int
    num_nodes: int


def build_node_groups(group: dist.ProcessGroup, intra_node_size: int) -> NodeGroups:
    """Create the subgroups of ``group``; collective over the default group.

    ``dist.new_group`` must be entered by every rank of the default group in the same
    order, so ``group`` must span the whole default group (1-D FSDP over all ranks).
    """
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            "intra_node_size needs the FSDP shard group to span every rank "
            f"(group has {len(ranks)} of {dist.get_world_size()} ranks)"
        )
    k = intra_node_size
    num_nodes = len(ranks) // k
    me = ranks.index(dist.get_rank())
    intra_node = inter_node = None
    for node in range(num_nodes):
        pg = dist.new_group(ranks[node * k : (node + 1) * k])
        if me // k == node:
            intra_node = pg
    for local in range(k):
        pg = dist.new_group(ranks[local::k])
        if me % k == local:
            inter_node = pg
    return NodeGroups(intra_node, inter_node, k, num_nodes)


def node_local_reduce_scatter(
    input_tensor: torch.Tensor, groups: NodeGroups
) -> tuple[torch.Tensor, int]:
    """Sum, inside the node, the ``N`` chunks bound for this rank's local index.

    ``input_tensor`` is rank-major ``[N * k * S]``. Returns ``[N, S]`` (row ``n`` is the node
    sum of chunk ``n * k + local``, still to be reduced across nodes) and the bytes sent.
    """
    k, n = groups.intra_node_size, groups.num_nodes
    by_node = input_tensor.view(n, k, -1)
    partial = by_node.new_empty(n, by_node.shape[2])
    # one reduce-scatter per node block reads the input in place (no transposed copy)
    for node in range(n):
        _reduce_scatter(
            output=partial[node],
            input=by_node[node].view(-1),
            op=dist.ReduceOp.SUM,
            group=groups.intra_node,
        )
    return partial, (k - 1) * partial.numel() * partial.element_size()
