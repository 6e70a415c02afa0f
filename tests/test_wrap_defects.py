"""Issue 11's wrap defects on 2 gloo ranks: tied modules grouped into one unit train like
one process; a ParameterList is never a unit (forward used to fail with mixed
Tensor/DTensor); a CustomPolicy result for the root is ignored, as FSDP1 does."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import CustomPolicy

import fsdp_ext
from benchmarks.wrap_models import MLPBlock, ModelWithFineGrainedBlock
from fsdp_ext.testing import WireCounter, run_distributed
from tests.test_wrap_policy import _TiedBlocks, _TiedHead

WORLD = 2
STEPS = 3


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.scales = nn.ParameterList([nn.Parameter(torch.full((8,), 1.5)) for _ in range(2)])
        self.head = nn.Linear(8, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(tokens)) * self.scales[0] + self.scales[1]
        return self.head(x)


_MODELS = {
    "tied_head": (_TiedHead, 64, fsdp_ext.GranularityPolicy(0)),
    "tied_blocks": (_TiedBlocks, 32, fsdp_ext.GranularityPolicy()),
    "parameter_list": (_Scaled, 32, fsdp_ext.GranularityPolicy(0)),
}


def _tokens(vocab: int, rank: int, step: int) -> torch.Tensor:
    return torch.randint(
        0, vocab, (2, 7), generator=torch.Generator().manual_seed(99 * step + rank)
    )


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _defects_rank() -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for name, (factory, vocab, policy) in _MODELS.items():
        torch.manual_seed(0)
        model = factory()
        units = [u.fqn for u in fsdp_ext.plan_units(model, policy).units]
        fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=mesh)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            loss = _lm_loss(model, _tokens(vocab, dist.get_rank(), step))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[name] = {"units": units, "losses": losses}
    # A CustomPolicy dict for the root is not applied (FSDP1 wraps the root with the
    # caller's kwargs): the root stays gathered after forward and gathers once a step.
    counter = WireCounter().open()  # this rank's process only
    model = ModelWithFineGrainedBlock(num_block=2)
    policy = CustomPolicy(
        lambda m: {"reshard_after_forward": True} if m is model else isinstance(m, MLPBlock)
    )
    fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=mesh)
    model(torch.randn(2, 128)).sum().backward()
    before = counter.calls.get("all_gather", 0)
    model(torch.randn(2, 128)).sum().backward()
    out["root_gathers"] = counter.calls.get("all_gather", 0) - before
    out["root_auto_reshard"] = model._get_fsdp_state()._auto_reshard_after_forward
    return out


def _reference(factory, vocab: int) -> list[list[float]]:
    torch.manual_seed(0)
    model = factory()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    per_rank: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        losses = [_lm_loss(model, _tokens(vocab, r, step)) for r in range(WORLD)]
        torch.stack(losses).mean().backward()
        optim.step()
        optim.zero_grad()
        for r in range(WORLD):
            per_rank[r].append(losses[r].item())
    return per_rank


def test_tied_groups_parameter_lists_and_root_custom_policy_on_2_ranks():
    ranks = run_distributed(_defects_rank, WORLD, timeout=240)
    assert ranks[0]["tied_head"]["units"][1] == "embed+head"
    assert "blocks.0+blocks.3" in ranks[0]["tied_blocks"]["units"]
    assert not any("scales" in u for u in ranks[0]["parameter_list"]["units"])
    for name, (factory, vocab, _) in _MODELS.items():
        want = _reference(factory, vocab)
        for r, result in enumerate(ranks):
            torch.testing.assert_close(result[name]["losses"], want[r], rtol=1e-5, atol=1e-6)
    for r in ranks:
        # Root once, two MLPBlocks in forward and again in backward.
        assert r["root_gathers"] == 1 + 2 * 2
        assert r["root_auto_reshard"]
