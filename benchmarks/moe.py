"""MoE expert parallelism: layout invariance and throughput, on gloo ranks it launches.

One tiny MoE LM, one init and one global batch per step, trained (a) in a single process
and (b) under each layout ``(world, ep)``. It reports the largest relative difference of
any full gradient after step 1, of the clipped grad norm, of the losses over all steps,
and per layout the tokens/s and the all-to-all bytes each rank sends per step (counted
from the split sizes of every exchange, forward and backward).

    PYTHONPATH=. python benchmarks/moe.py [--steps 10] [--layouts 2x1,2x2] [--bf16]

The last printed line is ``{"bench": "moe", ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_ext import MoE, ParallelDims, apply_expert_parallel, clip_grad_norm_, shard_moe_model
from fsdp_ext.moe.expert_parallel import AllToAllDispatcher


@dataclass(frozen=True)
class Case:
    vocab: int = 64
    dim: int = 32
    hidden_dim: int = 48
    shared_hidden_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_layers: int = 2
    global_batch: int = 8
    seq_len: int = 16
    load_balance_coef: float = 0.01
    steps: int = 10
    lr: float = 3e-3
    max_norm: float = 0.5
    seed: int = 0


class Block(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.norm1 = nn.LayerNorm(case.dim)
        self.mix = nn.Linear(case.dim, case.dim)
        self.norm2 = nn.LayerNorm(case.dim)
        self.feed_forward = MoE(
            case.dim,
            case.hidden_dim,
            case.num_experts,
            case.top_k,
            shared_hidden_dim=case.shared_hidden_dim,
            load_balance_coef=case.load_balance_coef,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class TinyMoELM(nn.Module):
    """Token embedding, blocks of (dense mix + MoE), head: enough for dense and expert grads."""

    def __init__(self, case: Case):
        super().__init__()
        self.embed = nn.Embedding(case.vocab, case.dim)
        self.layers = nn.ModuleList(Block(case) for _ in range(case.num_layers))
        self.norm = nn.LayerNorm(case.dim)
        self.head = nn.Linear(case.dim, case.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(case: Case) -> TinyMoELM:
    torch.manual_seed(case.seed)
    return TinyMoELM(case)


def global_batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed * 1000 + step)
    tokens = torch.randint(case.vocab, (case.global_batch, case.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def reference_run(case: Case) -> dict:
    """Single process, global batch, plain torch: the numbers every layout must match."""
    model = build_model(case)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.0)
    out = {"losses": [], "norms": []}
    for step in range(case.steps):
        loss = lm_loss(model, *global_batch(case, step))
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_norm))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    return out


def rank_run(case: Case, ep: int, bf16: bool = False, timed_steps: int = 0) -> dict:
    """One rank of a layout: same init, its slice of each global batch, FSDP + EP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world = dist.get_world_size()
    dims = ParallelDims(world, ep=ep)
    dims.build_mesh("cpu")
    model = build_model(case)
    apply_expert_parallel(model, dims)
    kwargs = {}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    shard_moe_model(model, dims, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.0)
    dp_rank, per_rank = dims.dp_flat_mesh.get_local_rank(), case.global_batch // dims.dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    dp_group = dims.dp_flat_mesh.get_group()
    dispatchers = [
        m.experts.dispatcher
        for m in model.modules()
        if isinstance(m, MoE) and isinstance(m.experts.dispatcher, AllToAllDispatcher)
    ]

    def step(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = global_batch(case, i)
        loss = lm_loss(model, inputs[rows], targets[rows])
        loss.backward()
        return loss.detach()

    out = {"losses": [], "norms": []}
    for i in range(case.steps):
        loss = step(i)
        if i == 0:
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out["norms"].append(clip_grad_norm_(model.parameters(), case.max_norm))
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss, group=dp_group)  # gloo has no AVG all-reduce
        out["losses"].append(loss.item() / dims.dp)
    if timed_steps:
        sent_before = sum(d.bytes_sent for d in dispatchers)
        dist.barrier()
        start = time.perf_counter()
        for i in range(timed_steps):
            step(case.steps + i)
            clip_grad_norm_(model.parameters(), case.max_norm)
            opt.step()
            opt.zero_grad()
        dist.barrier()
        elapsed = time.perf_counter() - start
        out["tokens_per_s"] = timed_steps * case.global_batch * case.seq_len / elapsed
        out["a2a_bytes_per_step"] = (sum(d.bytes_sent for d in dispatchers) - sent_before) / (
            timed_steps
        )
    return out


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale, not to each tiny entry."""
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp_min(1e-30)
    return float((a - b).abs().max() / scale)


def compare(reference: dict, run: dict) -> dict:
    grads = max(max_rel_diff(run["grads"][n], g) for n, g in reference["grads"].items())
    norm = max(
        abs(float(a) - float(b)) / float(b)
        for a, b in zip(run["norms"], reference["norms"], strict=True)
    )
    first_norm = abs(float(run["norms"][0]) - float(reference["norms"][0])) / float(
        reference["norms"][0]
    )
    losses = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"], strict=True))
    return {
        "max_grad_rel_diff": grads,
        "grad_norm_rel_diff": first_norm,
        "grad_norm_rel_diff_all_steps": norm,
        "max_loss_abs_diff": losses,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--layouts", default="2x1,2x2", help="world x ep, comma separated")
    parser.add_argument("--bf16", action="store_true", help="also run bf16 param dtype")
    args = parser.parse_args(argv)
    from tests.dist import run_distributed

    case = Case(steps=args.steps)
    reference = reference_run(case)
    results, tokens_per_s, a2a = {}, {}, {}
    for layout in args.layouts.split(","):
        world, ep = (int(v) for v in layout.split("x"))
        for bf16 in (False, True) if args.bf16 else (False,):
            name = f"world{world}_ep{ep}" + ("_bf16" if bf16 else "")
            runs = run_distributed(rank_run, world, case, ep, bf16, args.timed_steps)
            figures = compare(reference, runs[0])
            figures["tokens_per_s"] = runs[0].get("tokens_per_s")
            figures["a2a_bytes_per_step_per_rank"] = max(
                r.get("a2a_bytes_per_step", 0) for r in runs
            )
            results[name] = figures
            if not bf16:
                tokens_per_s[name] = round(figures["tokens_per_s"], 1)
                a2a[name] = figures["a2a_bytes_per_step_per_rank"]
            print(name, json.dumps({k: v for k, v in figures.items()}), flush=True)
    fp32 = [v for k, v in results.items() if not k.endswith("bf16")]
    summary = {
        "bench": "moe",
        "case": asdict(case),
        "layouts": results,
        "max_grad_rel_diff": max(v["max_grad_rel_diff"] for v in fp32),
        "grad_norm_rel_diff": max(v["grad_norm_rel_diff"] for v in fp32),
        "max_loss_abs_diff": max(v["max_loss_abs_diff"] for v in fp32),
        "tokens_per_s": tokens_per_s,
        "a2a_bytes_per_step": a2a,
        "machine": "2-core CPU, gloo",
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
