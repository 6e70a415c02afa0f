"""What differs between the torch releases we claim (2.11 to 2.15) and between CPU and GPU
machines, shown on this machine.

- A gloo rank whose default ``fully_shard`` mesh is built on CUDA (as on a GPU machine)
  fails where it lets torch pick the mesh, so the default run, which does that in every
  rank (conftest), proves that no gloo test relies on the default mesh.
- Memory accounting reads each unsharded gradient once: torch 2.15 turned
  ``FSDPParam.unsharded_accumulated_grad`` into an alias of the parameter's ``.grad``.
- The mixed-precision policy is read per parameter (2.15 keeps none on the param group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdp_ext._torch import fsdp_params, param_groups, param_mp_policy, unsharded_param
from fsdp_ext.testing import RankError, run_distributed
from fsdp_ext.testing.multiprocess import FAKE_CUDA_ENV
from fsdp_ext.wrap.measure import live_unsharded_split
from tests.meshes import cpu_mesh


def _shard(explicit_mesh: bool) -> str:
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=cpu_mesh() if explicit_mesh else None)
    return model.weight.device_mesh.device_type


def test_ranks_fail_on_a_cuda_default_mesh_and_pass_with_a_cpu_mesh(monkeypatch):
    monkeypatch.setenv(FAKE_CUDA_ENV, "1")
    assert run_distributed(_shard, 2, True) == ["cpu", "cpu"]
    with pytest.raises(RankError, match=r"(?i)cuda|nvidia"):
        run_distributed(_shard, 2, False)


def test_the_default_run_builds_default_meshes_on_cuda_in_gloo_ranks():
    """conftest sets it on a machine without CUDA (a GPU machine reports CUDA itself)."""
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device: ranks see it without faking")
    import os

    assert os.environ.get(FAKE_CUDA_ENV) == "1"


def _no_sync_grads() -> tuple[int, int, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(model[0], mesh=cpu_mesh(), mp_policy=mp)
    fully_shard(model, mesh=cpu_mesh(), mp_policy=MixedPrecisionPolicy())
    model.set_requires_gradient_sync(False)  # gradients stay unsharded, in the parameters
    model(torch.randn(4, 16)).sum().backward()
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in param_groups(m)]
    expected = sum(
        unsharded_param(p).grad.numel() * unsharded_param(p).grad.element_size()
        for g in groups
        for p in fsdp_params(g)
        if unsharded_param(p) is not None and unsharded_param(p).grad is not None
    )
    policies = [str(param_mp_policy(g, p).param_dtype) for g in groups for p in fsdp_params(g)]
    dist.barrier()
    return live_unsharded_split(groups)[1], expected, policies


def test_unsharded_gradients_are_counted_once_and_policies_read_per_parameter():
    for counted, expected, policies in run_distributed(_no_sync_grads, 2):
        assert expected > 0
        assert counted == expected  # 2.15 without the shim: 2x
        # the root (its own policy) gathers as stored, the inner unit in bf16
        assert policies == ["None", "None", "torch.bfloat16", "torch.bfloat16"], policies
