"""Per-rank program of benchmarks/cluster.py: examples/train.py per configuration, recorded.

    torchrun ... benchmarks/cluster_rank.py SPEC_JSON     (the lab's torchrun runs it)

SPEC_JSON is ``{"common": [train args], "runs": [[name, [train args]], ...]}``. For each
run in turn, ``examples.train.main(common + args, own_process_group=False)`` trains inside
one process group that this program opens once (re-initialising the default group under
torchrun's agent store hangs, and one job for all configurations saves a launch per
configuration). On the side it records:

- at every optimizer step (a global post-step hook): the time, and on each node's local
  rank 0 the kernel's counters of the node's link (``/sys/class/net/<link>/statistics``);
- every torch.distributed collective, counted by ``fsdp_ext.testing.WireCounter``: the
  bytes this rank sends to ranks on other nodes, by kind (all-gather, reduce-scatter/
  all-to-all, other). Which peer gets what follows gloo's algorithms as measured in the
  lab (docs/cluster.md, ``gloo_algorithms=True``): ring all-gather, reduce-scatter as a
  ring all-reduce of the whole input, ring all-reduce, direct all-to-all, broadcast
  straight from the root.

Prints one line ``CLUSTER_RECORD {json}`` per run, on every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_ext.testing import WireCounter

KINDS = ("all_gather", "reduce_scatter", "other")
RECORD_TAG = "CLUSTER_RECORD "


#: WireCounter's kinds in this benchmark's three (the rest is "other")
BUCKETS = {
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "reduce_scatter",
}


def cross_node_bytes(wire: WireCounter) -> dict[str, int]:
    """Bytes this rank has sent to ranks on other nodes, by :data:`KINDS` (cumulative)."""
    out = dict.fromkeys(KINDS, 0)
    for kind, nbytes in wire.cross.items():
        out[BUCKETS.get(kind, "other")] += nbytes
    return out


def link_counters() -> dict[str, int] | None:
    """This node's link counters (read by local rank 0 only; None elsewhere)."""
    if os.environ.get("LOCAL_RANK") != "0":
        return None
    link = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    base = Path(f"/sys/class/net/{link}/statistics")
    return {k: int((base / f"{k}_bytes").read_text()) for k in ("tx", "rx")}


def _snapshot(wire: WireCounter, elapsed: float) -> dict:
    # cpu: this rank's CPU seconds, every thread (gloo's included)
    cpu = time.process_time()
    return {"t": elapsed, "cpu": cpu, "link": link_counters(), "cross": cross_node_bytes(wire)}


def _advance(total: dict, before: dict, after: dict, forward_end: dict | None = None) -> dict:
    """``total`` moved on by what happened between two snapshots; ``forward_end``, taken
    when the model's forward returned, also moves on the forward's share (``fwd_t``, and
    ``fwd_tx``: the link bytes sent in the forward, on a node's local rank 0)."""
    out = {"t": total["t"] + after["t"] - before["t"], "cross": dict(total["cross"])}
    out["cpu"] = total["cpu"] + after["cpu"] - before["cpu"]
    if forward_end is not None:
        out["fwd_t"] = total.get("fwd_t", 0.0) + forward_end["t"] - before["t"]
        if before["link"] is not None:
            sent = forward_end["link"]["tx"] - before["link"]["tx"]
            out["fwd_tx"] = total.get("fwd_tx", 0) + sent
    for kind in KINDS:
        out["cross"][kind] += after["cross"][kind] - before["cross"][kind]
    out["link"] = None
    if total["link"] is not None:
        out["link"] = {
            k: total["link"][k] + after["link"][k] - before["link"][k] for k in total["link"]
        }
    return out


def rotate(spec: dict, wire: WireCounter) -> None:
    """Every configuration built side by side in this process group (``--comm auto``
    measures and decides while the others sit idle), then trained one step each in turn,
    the order rotated step by step, so load from other work on the machine slows every
    configuration alike. Per configuration, its own steps' time, link bytes and wrapped
    collectives are summed into the same record ``main`` prints (``steps``: cumulative)."""
    import dataclasses

    import examples.train as train
    from examples.config import decide_comm, parse_args
    from examples.data import get_batch, load_corpus
    from examples.model import Transformer
    from fsdp_ext import ParallelDims, clip_grad_norm_

    world, rank = dist.get_world_size(), dist.get_rank()
    jobs = {}
    forward_ends: dict[str, dict] = {}
    start = time.perf_counter()
    for name, args in spec["runs"]:
        cfg = parse_args([*spec["common"], *args], world_size=world)
        cfg = dataclasses.replace(cfg, verbose=False)
        torch.manual_seed(cfg.seed)
        model = Transformer(cfg.model)
        dims = ParallelDims(world, ep=cfg.ep, pp=cfg.pp)
        dims.build_mesh("cpu")
        cfg = decide_comm(cfg, model, world)
        par = train.parallelize(model, cfg, dims)
        params = [p for part in par.parts for p in part.parameters()]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, train.lr_lambda(cfg))
        jobs[name] = (cfg, par, params, opt, sched)
        if len(par.parts) == 1:  # the forward's end: the root module's forward hook
            par.parts[0].register_forward_hook(
                lambda *_, name=name: forward_ends.__setitem__(
                    name, _snapshot(wire, time.perf_counter() - start)
                )
            )
    corpus = load_corpus()
    names = list(jobs)
    cfg0 = jobs[names[0]][0]
    local = cfg0.batch_size // world

    def batch(data, seed, step):
        x, y = get_batch(
            data, seed=seed, step=step, batch_size=cfg0.batch_size, seq_len=cfg0.seq_len
        )
        return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]

    totals = {name: [_snapshot(wire, 0.0)] for name in names}
    losses = {name: [] for name in names}
    for step in range(cfg0.steps):
        x, y = batch(corpus.train, cfg0.seed, step)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            cfg, par, params, opt, sched = jobs[name]
            dist.barrier()
            forward_ends.pop(name, None)
            before = _snapshot(wire, time.perf_counter() - start)
            losses[name].append(par.train_step(x, y))
            clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            dist.barrier()  # the step ends when its slowest rank is done
            after = _snapshot(wire, time.perf_counter() - start)
            end = forward_ends.get(name)
            totals[name].append(_advance(totals[name][-1], before, after, end))
    for index, name in enumerate(names):
        cfg, par, *_ = jobs[name]
        with torch.no_grad():
            val = [
                par.eval_step(*batch(corpus.val, cfg.seed + 1, i)) for i in range(cfg.val_batches)
            ]
        steps = totals[name][1:]
        record = {
            "config": name,
            "run": index,
            "rank": rank,
            "node": int(os.environ["GROUP_RANK"]),
            "steps": steps,
            "val_loss": sum(val) / len(val),
            "final_loss": losses[name][-1],
            "train_step_ms": None,
            "comm_stats": None if par.comm is None else dataclasses.asdict(par.comm.stats),
            "comm_auto": None if cfg.auto is None else cfg.auto.choice.name,
            "comm_auto_predicted_ms": None if cfg.auto is None else cfg.auto.predicted_ms(),
            "comm_auto_probe_s": None if cfg.auto is None else cfg.auto.measurements.probe_s,
        }
        print(RECORD_TAG + json.dumps(record), flush=True)


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    # gloo's algorithms, as the link counters see them; open before fsdp_ext binds any
    # collective by name, for the whole process
    wire = WireCounter(int(os.environ["LOCAL_WORLD_SIZE"]), gloo_algorithms=True).open()
    if spec.get("rotate"):
        dist.init_process_group("gloo")
        try:
            rotate(spec, wire)
        finally:
            dist.destroy_process_group()
        return
    steps: list[dict] = []

    def after_step(optimizer, args, kwargs) -> None:
        now = {"t": time.time(), "cpu": time.process_time(), "link": link_counters()}
        now["cross"] = cross_node_bytes(wire)
        steps.append(now)

    register_optimizer_step_post_hook(after_step)
    import examples.train as train

    dist.init_process_group("gloo")
    try:
        for index, (name, args) in enumerate(spec["runs"]):
            steps.clear()
            summary = train.main([*spec["common"], *args], own_process_group=False)
            record = {
                "config": name,
                "run": index,
                "rank": int(os.environ["RANK"]),
                "node": int(os.environ["GROUP_RANK"]),
                "steps": list(steps),
                "val_loss": summary["val_loss"],
                "final_loss": summary["losses"][-1],
                "train_step_ms": summary["step_ms"],
                "comm_stats": summary["comm_stats"],
                "comm_auto": summary.get("comm_auto"),
            }
            print(RECORD_TAG + json.dumps(record), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
