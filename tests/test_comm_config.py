"""The codecs' options (LoCoConfig, Q4Config) and CommConfig: every error names its argument,
and the limits are the codec's own. Then enable's refusals."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from fsdp_ext import CommConfig, LoCoConfig, Q4Config, enable
from fsdp_ext.comm.absmax_codec import AbsmaxCodec
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bits", 2),
        ("bits", True),
        ("group_size", 16),
        ("group_size", 96),
        ("group_size", 128.0),
        ("err_beta", 1.0),
        ("err_beta", -0.1),
        ("reset_interval", 0),
        ("error_dtype", torch.float16),
    ],
)
def test_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        LoCoConfig(**{field: value})


def test_limits_are_the_codecs_own():
    """The codec takes group sizes down to 8 on CPU; its CUDA kernels from 32, checked for
    every config so it runs alike everywhere. The config adds no limit of its own."""
    assert AbsmaxCodec(4, 8).group_size == 8
    for config in (LoCoConfig, Q4Config):
        with pytest.raises(ValueError, match=r"Triton kernels take group_size in \(32,"):
            config(group_size=16)
        assert config(group_size=32).group_size == 32
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        Q4Config(bits=2)


def test_config_defaults():
    cfg = LoCoConfig()
    assert (cfg.bits, cfg.group_size, cfg.err_beta, cfg.reset_interval) == (4, 128, 0.8, 1024)
    assert cfg.error_dtype == torch.int8 and cfg.codec == "loco" and Q4Config().codec == "q4"
    assert not hasattr(cfg, "error_feedback") and not hasattr(cfg, "intra_node_size")


def test_one_node_size_on_comm_config():
    cfg = CommConfig(gradients="loco", hierarchical=True, hpz=True, node_size=2)
    assert cfg.gradients == LoCoConfig() and cfg.node_size == 2
    with pytest.raises(ValueError, match=r"CommConfig\.node_size"):
        CommConfig(gradients="loco", hierarchical=True, node_size="nodes")
    with pytest.raises(ValueError, match=r"CommConfig\.hierarchical sends a gradient codec"):
        CommConfig(hierarchical=True)


def test_plan_nodes_cuts_any_group_by_physical_node():
    from fsdp_ext.comm.hierarchical import plan_nodes

    # the whole job, 2 nodes of 2
    assert plan_nodes([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # a strided sub-mesh (e.g. efsdp over ranks 1, 3, 5, 7 with 4 ranks per node)
    assert plan_nodes([1, 3, 5, 7], 4) == ([[1, 3], [5, 7]], [[1, 5], [3, 7]])
    # HSDP's shard group inside one node: a single node, nothing to quantise across
    assert plan_nodes([2, 3], 4) == ([[2, 3]], [[2], [3]])
    with pytest.raises(ValueError, match="node_size=2"):
        plan_nodes([0, 1, 2], 2)


def _refusals():
    errors = {}
    with pytest.raises(ValueError, match="no FSDP unit") as e:
        enable(nn.Linear(4, 4), CommConfig(gradients="loco"))
    errors["unsharded"] = str(e.value)
    with pytest.raises(ValueError, match=r"CommConfig\.gradients must be"):
        CommConfig(gradients={"bits": 4})
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    hsdp = fully_shard(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(ValueError, match="dp_shard mesh only"):
        enable(hsdp, CommConfig(gradients="loco"), replicate_group=mesh["dp_replicate"].get_group())
    with pytest.raises(ValueError, match="node_size must divide"):
        enable(
            fully_shard(nn.Linear(4, 4), mesh=cpu_mesh()),
            CommConfig(gradients=LoCoConfig(), hierarchical=True, node_size=3),
        )
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )
    except ImportError:  # per-parameter meshes are newer than torch 2.11
        return errors
    # a second process group over the same ranks makes a second param group
    other_mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu")
    other = FSDPMeshInfo(mesh=other_mesh, shard_mesh_dim=0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(
        model,
        shard_placement_fn=lambda p: (
            ShardPlacementResult(Shard(0), other) if p is model[1].weight else None
        ),
        mesh=cpu_mesh(),
    )
    with pytest.raises(ValueError, match="several param groups"):
        enable(model, CommConfig(gradients="loco"))
    errors["groups"] = True
    dist.barrier()
    return errors


def test_register_refuses_what_it_cannot_serve():
    import torch.distributed.fsdp._fully_shard._fsdp_common as common

    for errors in run_distributed(_refusals, 2):
        assert "fully_shard" in errors["unsharded"]
        # the several-param-groups refusal ran wherever torch has per-parameter meshes
        assert bool(errors.get("groups")) == hasattr(common, "ShardPlacementResult")


@pytest.mark.parametrize("group_size", [8192, 16384])
def test_a_group_size_the_cuda_kernels_cannot_run_is_refused_when_the_config_is_built(group_size):
    """On any device: the config is refused before any worker starts, naming the sizes."""
    with pytest.raises(ValueError, match=r"LoCoConfig: .*group_size in \(32, 64, .*, 4096\)"):
        LoCoConfig(group_size=group_size)
    for ok in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        assert LoCoConfig(group_size=ok).group_size == ok


def test_a_group_size_the_cuda_kernels_cannot_run_is_refused_at_registration():
    from fsdp_ext.comm.register import check_codec_device

    def codec(group_size):
        return AbsmaxCodec(group_size=group_size)

    cuda = torch.device("cuda", 0)
    with pytest.raises(
        ValueError,
        match=r"unit layers.0 reduces on cuda:0: .*group_size in \(32, 64, .*, 4096\); "
        r"got group_size=8192",
    ):
        check_codec_device(codec(8192), cuda, "layers.0")
    check_codec_device(codec(256), cuda, "layers.0")
    check_codec_device(codec(8192), torch.device("cpu"), "layers.0")
