"""MoE expert parallelism: layout invariance and throughput, on gloo ranks it launches.

One tiny MoE LM, one init and one global batch per step, trained (a) in a single process
and (b) under each layout ``(world, ep)``. It reports the largest relative difference of
any full gradient after step 1, of the clipped grad norm, of the losses over all steps,
and per layout the tokens/s and the all-to-all bytes each rank sends per step (counted
from the split sizes of every exchange, forward and backward).

    PYTHONPATH=. python benchmarks/moe.py [--steps 10] [--layouts 2x1,2x2,4x1,4x2,4x4] [--quick]

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

from fsdp_ext import (
    MoE,
    ParallelDims,
    all_to_all_stats,
    apply_expert_parallel,
    clip_grad_norm_,
    shard_moe_model,
)


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


def rank_run(
    case: Case, ep: int, bf16: bool = False, timed_steps: int = 0, dp_replicate: int = 1
) -> dict:
    """One rank of a layout: same init, its slice of each global batch, FSDP + EP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world = dist.get_world_size()
    dims = ParallelDims(world, dp_replicate=dp_replicate, ep=ep)
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
        sent_before = all_to_all_stats(model).bytes_sent
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
        sent = all_to_all_stats(model).bytes_sent - sent_before
        out["a2a_bytes_per_step"] = sent / timed_steps
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


# Throughput: the example's MoE shape (dim 128, 8 experts of 192, top-2), 16 x 128 tokens.
THROUGHPUT_CASE = Case(
    vocab=256,
    dim=128,
    hidden_dim=192,
    shared_hidden_dim=0,
    num_layers=4,
    global_batch=16,
    seq_len=128,
    steps=2,
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps compared with the reference")
    parser.add_argument(
        "--layouts",
        default="2x1,2x2,4x1,4x2,4x4,4x1x2,4x2x2",
        help="world x ep [x dp_replicate], comma separated",
    )
    parser.add_argument("--bf16-layouts", default="2x1,2x2", help="'' to skip bf16")
    parser.add_argument("--timed-steps", type=int, default=10, help="0 skips throughput")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 2x2 only")
    args = parser.parse_args(argv)
    throughput_case = THROUGHPUT_CASE
    if args.quick:
        args.steps, args.layouts, args.bf16_layouts, args.timed_steps = 2, "2x2", "", 1
        throughput_case = Case(steps=1)
    from fsdp_ext.testing import run_distributed

    case = Case(steps=args.steps)
    reference = reference_run(case)
    invariance, bf16_runs = {}, {}
    for layout in args.layouts.split(","):
        world, ep, replicate = ([int(v) for v in layout.split("x")] + [1])[:3]
        run = run_distributed(rank_run, world, case, ep, False, 0, replicate)[0]
        name = f"world{world}_ep{ep}" + (f"_hsdp{replicate}" if replicate > 1 else "")
        invariance[name] = compare(reference, run)
        print(name, json.dumps(invariance[name]), flush=True)
    for layout in filter(None, args.bf16_layouts.split(",")):
        world, ep = (int(v) for v in layout.split("x"))
        bf16_runs[layout] = run = run_distributed(rank_run, world, case, ep, True)[0]
        figures = compare(reference, run)
        dense = [n for n in reference["grads"] if ".experts." not in n and ".router." not in n]
        figures["max_dense_grad_rel_diff"] = max(
            max_rel_diff(run["grads"][n], reference["grads"][n]) for n in dense
        )
        invariance[f"world{world}_ep{ep}_bf16_vs_fp32"] = figures
        print(f"world{world}_ep{ep}_bf16_vs_fp32", json.dumps(figures), flush=True)
    if len(bf16_runs) > 1:
        (first, base), *others = bf16_runs.items()
        for layout, run in others:
            name = f"bf16_{layout}_vs_{first}"
            invariance[name] = compare(base, run)
            print(name, json.dumps(invariance[name]), flush=True)

    tokens_per_s, a2a_bytes = {}, {}
    if args.timed_steps:
        tokens = throughput_case.global_batch * throughput_case.seq_len
        for ep in (1, 2):
            runs = run_distributed(rank_run, 2, throughput_case, ep, False, args.timed_steps)
            tokens_per_s[f"ep{ep}"] = round(runs[0]["tokens_per_s"], 1)
            a2a_bytes[f"ep{ep}"] = max(r["a2a_bytes_per_step"] for r in runs)
            print(
                f"throughput world2 ep{ep}: {tokens_per_s[f'ep{ep}']} tokens/s "
                f"({tokens} tokens/step), all-to-all {a2a_bytes[f'ep{ep}'] / 1e6:.3f} MB "
                "sent per rank per step",
                flush=True,
            )

    fp32 = [v for k, v in invariance.items() if "bf16" not in k]
    summary = {
        "bench": "moe",
        "max_grad_rel_diff": max(v["max_grad_rel_diff"] for v in fp32),
        "grad_norm_rel_diff": max(v["grad_norm_rel_diff"] for v in fp32),
        "max_loss_abs_diff": max(v["max_loss_abs_diff"] for v in fp32),
        "tokens_per_s": tokens_per_s,
        "a2a_bytes_per_step_per_rank": a2a_bytes,
        "invariance": invariance,
        "case": asdict(case),
        "throughput_case": asdict(throughput_case),
        "machine": "2-core CPU, gloo",
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
