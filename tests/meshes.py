"""Meshes for gloo test ranks.

``fully_shard`` without a mesh lets torch pick the device: CUDA on a GPU machine, even in
a gloo rank, where rank 1 of a one-GPU box then dies with "invalid device ordinal". Every
gloo test passes a CPU mesh instead; ``tests/test_torch_versions.py`` shows the suite's
ranks never rely on the default.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def cpu_mesh() -> DeviceMesh:
    """The whole world as a 1-D CPU mesh (the mesh ``fully_shard`` defaults to on a CPU box)."""
    return init_device_mesh("cpu", (dist.get_world_size(),))
