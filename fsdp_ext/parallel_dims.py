"""Parallel degrees, validated once, and the one DeviceMesh every parallelism slices.

The mesh has four named dims, outermost first: ``pp``, ``dp_replicate``, ``efsdp``,
``ep``, with ``dp_shard = efsdp * ep``. Keeping ``ep`` innermost puts an expert-parallel
group on neighbouring ranks (the all-to-all is the chattiest collective). Every other
group is a flattened view of the same root mesh, so FSDP can join the expert-data-parallel
mesh with the ``ep`` mesh of an expert DTensor (both must share one root).

Views (1-D unless ``dp_replicate > 1``, then ``(dp_replicate, shard)`` for HSDP):
  - ``dp_mesh``: dense data parallel, ``(dp_replicate, dp_shard)``.
  - ``ep_mesh``: the ranks that split the experts between them.
  - ``efsdp_mesh``: ranks that hold the same experts and shard them with FSDP.
  - ``edp_mesh``: expert data parallel, ``(dp_replicate, efsdp)``.
  - ``pp_mesh``: pipeline stages.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_ext._torch import flatten_mesh, unflatten_mesh

__all__ = ["MESH_DIM_NAMES", "ParallelDims"]

MESH_DIM_NAMES = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass
class ParallelDims:
    """Degrees of each parallelism; ``dp_shard=-1`` takes whatever the others leave."""

    world_size: int
    _: KW_ONLY
    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    pp: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "dp_replicate", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"dp_shard must be an int >= 1 or -1 (infer), got {self.dp_shard!r}")
        others = self.dp_replicate * self.pp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"cannot infer dp_shard: world_size={self.world_size} is not divisible by "
                    f"dp_replicate * pp = {others}"
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate * dp_shard * pp = {self.dp_replicate} * {self.dp_shard} * "
                f"{self.pp} = {product} must equal world_size={self.world_size}"
            )
        if self.dp_shard % self.ep != 0:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard} (experts are split over "
                "ranks that also shard the dense model)"
            )

    @property
    def efsdp(self) -> int:
        """How many ranks shard each expert with FSDP: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        """The full data-parallel degree: every rank in it sees a different batch slice."""
        return self.dp_replicate * self.dp_shard

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.efsdp, self.ep)

    def rank_groups(self, name: str) -> list[list[int]]:
        """The rank groups of view ``name``, computed without a process group.

        Same layout as :meth:`build_mesh` (row-major over ``MESH_DIM_NAMES``): the spec the
        mesh is tested against.
        """
        dims = _VIEW_DIMS.get(name)
        if dims is None:
            raise ValueError(f"name must be one of {sorted(_VIEW_DIMS)}, got {name!r}")
        grid = torch.arange(self.world_size).reshape(self.mesh_shape)
        group_axes = [MESH_DIM_NAMES.index(d) for d in dims]
        other_axes = [a for a in range(len(MESH_DIM_NAMES)) if a not in group_axes]
        size = 1
        for a in group_axes:
            size *= self.mesh_shape[a]
        groups = grid.permute(*other_axes, *group_axes).reshape(-1, size)
        return groups.tolist()

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Create the world mesh and every flattened view; needs an initialised process group."""
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
        # Flattened views are kept here rather than sliced from the root again: torch is
        # deprecating root slicing of flattened dims.
        self._views = {
            name: mesh[dims] if len(dims) == 1 else flatten_mesh(mesh[dims], name)
            for name, dims in _VIEW_DIMS.items()
        }
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self._mesh

    def view(self, name: str) -> DeviceMesh:
        """The 1-D mesh of view ``name`` (one of ``_VIEW_DIMS``) that holds this rank."""
        self.world_mesh  # noqa: B018 -- raises if the mesh is not built yet
        if name not in self._views:
            raise ValueError(f"name must be one of {sorted(self._views)}, got {name!r}")
        return self._views[name]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The FSDP mesh for dense modules: 1-D ``dp_shard``, or 2-D HSDP."""
        if self.dp_replicate == 1:
            return self.view("dp_shard")
        mesh = unflatten_mesh(
            self.view("dp"), (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")
        )
        return self.world_mesh["dp_replicate", "dp_shard"] if mesh is None else mesh

    @property
    def edp_mesh(self) -> DeviceMesh:
        """The FSDP mesh for experts: 1-D ``efsdp``, or 2-D ``(dp_replicate, efsdp)``."""
        if self.dp_replicate == 1:
            return self.view("efsdp")
        return self.world_mesh["dp_replicate", "efsdp"]

    @property
    def dp_flat_mesh(self) -> DeviceMesh:
        """Every data-parallel rank as one 1-D mesh (global batch statistics)."""
        return self.view("dp")

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.view("ep")

    @property
    def efsdp_mesh(self) -> DeviceMesh:
        return self.view("efsdp")

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.view("pp")


# Each view and the mesh dims it spans (flattened when more than one).
_VIEW_DIMS: dict[str, tuple[str, ...]] = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "efsdp": ("efsdp",),
    "ep": ("ep",),
    "dp_shard": ("efsdp", "ep"),
    "edp": ("dp_replicate", "efsdp"),
    "dp": ("dp_replicate", "efsdp", "ep"),
}
