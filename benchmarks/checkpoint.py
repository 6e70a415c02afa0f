"""Benchmark DCP save planners and writers on 4 gloo ranks, plus a planner simulation.

Measured (4 gloo ranks, real files, sync_files=True everywhere): a 24-layer model of varied
layer sizes with a large embedding and output matrix, in three layouts (fully replicated,
HSDP 2 x 2, FSDP-sharded), saved by

  lowest_rank     stock FileSystemWriter + DefaultSavePlanner(dedup_save_to_lowest_rank=True)
  dcp_default     stock FileSystemWriter + DefaultSavePlanner()
  ours            SpreadFileSystemWriter + SpreadSavePlanner (CRC-32 manifest, atomic publish)
  ours_nocrc      the same without checksums (to measure what they cost)

Per layout and variant: bytes per rank (max/mean, from the files on disk), save seconds
(median of 5, 3 with --quick, after an untimed warm-up round; variants interleaved and their
order rotated each round), load seconds (each checkpoint loaded back by its own reader and
compared with the saved tensors), files.

Two more measurements say what the save times mean on the machine at hand:

  raw_write_speedup_4_vs_1   the model's bytes written with plain write + fsync by one rank,
                             then split over all four: the most that spreading writes can
                             gain on this storage, whatever the planner
  linked                     the replicated layout saved again with each rank's writes capped
                             at --link-mbps (default 200 MB/s, by sleeping): a modelled
                             per-rank link to storage, as on a cluster where every node has
                             its own NIC. A model of the hardware, not a measurement of it.

Simulated (``--simulate`` alone, or as part of every run): global save plans of real model
shapes built on the meta device (Llama-3-8B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B, bf16), fully
replicated and HSDP with 8-way sharding, at world sizes 8 to 1024; max/mean bytes per rank
for stock ``dedup_save_plans`` and for ours.

    python benchmarks/checkpoint.py --quick      # ~90 MB model, < 5 min
    python benchmarks/checkpoint.py              # ~340 MB model
    python benchmarks/checkpoint.py --simulate   # planner only, seconds
    python benchmarks/checkpoint.py --link-sweep 50,100,200,400,800,1600,0   # the link plot

In the cluster lab (``--lab``, root): 4 ranks on 4 (or 2) emulated nodes, each node's links
capped (``--lab-link`` Mbit/s, comma-separated to sweep), the checkpoint directory on the lab's
shared sshfs storage; a 63 MB model whose embedding is 1.5x a fair share. The three writers
(lowest rank, stock default, ours with checksums) save each layout, then each checkpoint is
loaded by its own reader, ``--lab-reps`` rounds after a warm-up, interleaved; the medians
give ``lab_save_speedup_vs_lowest_rank``, ``lab_save_ratio_vs_dcp_default`` and
``lab_load_ratio_vs_dcp_default`` (first rate, replicated layout). Each node's storage-link
interface counters give the bytes it sent and received per save and load.

    python benchmarks/checkpoint.py --lab --lab-link 100,200,400     # docs/checkpoint_lab.png

With ``--storage s3`` the lab's storage node runs an S3 server (SeaweedFS) instead of sshfs,
and two savers take turns on the same ranks and server: stock ``FsspecWriter`` /
``FsspecReader`` on s3fs with the stock planners, and our ``BlobStorageWriter`` /
``BlobStorageReader`` with ours; the last line has ``s3_save_ratio_vs_fsspec`` and
``s3_load_ratio_vs_fsspec`` (ours / stock, first rate, replicated layout) and the bytes each
node's storage link carried. s3fs cannot share this venv (its aiobotocore pins an older
botocore than our boto3): install it, with the boto3 it agrees with, into a directory of its
own and name it with ``--s3fs-path`` or ``FSDP_EXT_S3FS_PATH``. ``--quick`` with ``--lab``
measures the replicated layout only.

    python -m pip install --target /tmp/s3fs-site s3fs boto3
    FSDP_EXT_S3FS_PATH=/tmp/s3fs-site python benchmarks/checkpoint.py --lab --storage s3 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_ext.checkpoint import (
    BlobStorageReader,
    BlobStorageWriter,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
    item_nbytes,
    remove_checkpoint,
    spread_plans,
)
from fsdp_ext.lab import FABRIC_DEVICE, Cluster, teardown_on_termination, unavailable_reason
from fsdp_ext.testing import (
    create_write_items,
    dedup_save_plans,
    fsspec_writer_and_reader,
    run_distributed,
)

WORLD = 4
LAYOUTS = ("replicated", "hsdp", "fsdp")
VARIANTS = ("lowest_rank", "dcp_default", "ours", "ours_nocrc")
SIM_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
DOCS = Path(__file__).resolve().parent.parent / "docs"


# -- the measured model ----------------------------------------------------------------------


def model_shapes(dim: int, vocab: int, n_layers: int = 24) -> dict[str, tuple[int, ...]]:
    """A decoder's weights: layers whose MLP width cycles 1x..4x dim, an output matrix, and
    an embedding of twice the vocabulary (a fused multi-modal or padded table): bigger than
    a fair share of 4 ranks (a third of the rest), so the planner must split it."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (2 * vocab, dim)}
    for i in range(n_layers):
        ffn = dim * (1 + i % 4)
        shapes |= {
            f"layers.{i}.attn.wqkv.weight": (3 * dim, dim),
            f"layers.{i}.attn.wo.weight": (dim, dim),
            f"layers.{i}.mlp.w1.weight": (ffn, dim),
            f"layers.{i}.mlp.w2.weight": (dim, ffn),
            f"layers.{i}.norm.weight": (dim,),
        }
    shapes |= {"norm.weight": (dim,), "output.weight": (vocab, dim)}
    return shapes


def build_state(layout: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    if layout == "replicated":
        return {"model": full, "step": 100}
    if layout == "hsdp":
        mesh, placements = init_device_mesh("cpu", (2, WORLD // 2)), [Replicate(), Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (WORLD,)), [Shard(0)]
    return {
        "model": {k: distribute_tensor(v, mesh, placements) for k, v in full.items()},
        "step": 100,
    }


def zeros_like_state(state: dict) -> dict:
    out = {}
    for k, v in state["model"].items():
        if isinstance(v, DTensor):
            local = torch.zeros_like(v.to_local())
            out[k] = DTensor.from_local(
                local,
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        else:
            out[k] = torch.zeros_like(v)
    return {"model": out, "step": 0}


def same(a: dict, b: dict) -> bool:
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    return a["step"] == b["step"] and all(
        torch.equal(local(a["model"][k]), local(b["model"][k])) for k in a["model"]
    )


class _RankLink:
    """Caps one rank's file writes at ``bytes_per_s``: a modelled per-rank link (a node's NIC
    to shared storage). It sleeps, so it costs no CPU; every variant gets the same cap."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.start: float | None = None
        self.sent = 0

    def wait_for(self, nbytes: int) -> None:
        with self.lock:
            now = time.perf_counter()
            if self.start is None:
                self.start = now
            self.sent += nbytes
            delay = self.start + self.sent / self.rate - now
        if delay > 0:
            time.sleep(delay)


class _LinkedStream:
    def __init__(self, raw, link: _RankLink):
        self._raw, self._link = raw, link

    def write(self, data) -> int:
        written = self._raw.write(data)
        self._link.wait_for(memoryview(data).nbytes)
        return written

    def __getattr__(self, name):
        return getattr(self._raw, name)


class _LinkedFileSystem:
    """Wraps a writer's ``fs`` so that the streams it opens for writing go through the link."""

    def __init__(self, inner, link: _RankLink):
        self._inner, self._link = inner, link

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with self._inner.create_stream(path, mode) as stream:
            yield _LinkedStream(stream, self._link) if "w" in mode else stream

    def __getattr__(self, name):
        return getattr(self._inner, name)


def raw_write_seconds(root: Path, total: int, writers: int) -> float:
    """Plain open/write/fsync of ``total`` bytes split over ``writers`` ranks (the rest idle):
    the storage's own answer to how much spreading writes can gain, with no DCP in the way."""
    rank = dist.get_rank()
    data = torch.ones(total // writers, dtype=torch.uint8).numpy() if rank < writers else None

    def write():
        if data is None:
            return
        with open(root / f"raw-{rank}", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return timed(write)


def writer_and_planner(variant: str, path: Path, link_bytes_per_s: float | None = None):
    if variant == "lowest_rank":
        writer, planner = (
            dcp.FileSystemWriter(path),
            DefaultSavePlanner(dedup_save_to_lowest_rank=True),
        )
    elif variant == "dcp_default":
        writer, planner = dcp.FileSystemWriter(path), DefaultSavePlanner()
    else:
        writer, planner = (
            SpreadFileSystemWriter(path, checksums=variant == "ours"),
            SpreadSavePlanner(),
        )
    if link_bytes_per_s:
        writer.fs = _LinkedFileSystem(writer.fs, _RankLink(link_bytes_per_s))
    return writer, planner


def reader_and_planner(variant: str, path: Path):
    if variant.startswith("ours"):
        checked = variant == "ours"  # ours_nocrc has sizes only: load it on them
        return VerifiedFileSystemReader(path, require_checksums=checked), SafeLoadPlanner()
    return dcp.FileSystemReader(path), None


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def bytes_per_rank(path: Path) -> list[int]:
    """Bytes each rank wrote: the sizes on disk of its data files (``__R_...``)."""
    out = [0] * WORLD
    for f in path.iterdir():
        if f.suffix == ".distcp":
            out[int(f.name.split("_")[2])] += f.stat().st_size
    return out


def planned_bytes_per_rank(path: Path) -> list[int]:
    """Tensor bytes the plan gave each rank: the chunks ``.metadata`` says each file holds."""
    meta = dcp.FileSystemReader(path).read_metadata()
    out = [0] * WORLD
    for index, info in meta.storage_data.items():
        entry = meta.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            continue
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
        out[int(info.relative_path.split("_")[2])] += (
            chunk.sizes.numel() * entry.properties.dtype.itemsize
        )
    return out


def save_rounds(root: str, name: str, state: dict, reps: int, link: float | None) -> dict:
    """Save seconds per variant: a warm-up round (not timed: the first save of a process pays
    for page-cache growth and lazy setup), then ``reps`` rounds, variants interleaved and
    their order rotated each round."""
    rank = dist.get_rank()
    save_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps + 1):
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        for variant in order:
            path = Path(root) / f"{name}-{variant}"
            if rank == 0:
                remove_checkpoint(path)  # a link and its version, or a stock directory
            dist.barrier()
            writer, planner = writer_and_planner(variant, path, link)
            seconds = timed(
                functools.partial(dcp.save, state, storage_writer=writer, planner=planner)
            )
            if rep:
                save_s[variant].append(seconds)
    return save_s


def load_rounds(root: str, name: str, state: dict, reps: int) -> tuple[dict, dict]:
    """Load seconds per variant (each checkpoint by its own reader), ``reps`` rounds after an
    untimed warm-up, variants interleaved and rotated; and whether every load was exact."""
    load_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    correct = dict.fromkeys(VARIANTS, True)
    for rep in range(reps + 1):
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
        for variant in order:
            target = zeros_like_state(state)
            reader, planner = reader_and_planner(variant, Path(root) / f"{name}-{variant}")
            seconds = timed(
                functools.partial(dcp.load, target, storage_reader=reader, planner=planner)
            )
            correct[variant] &= same(target, state)
            if rep:
                load_s[variant].append(seconds)
    return load_s, correct


def _measure(
    root: str, dim: int, vocab: int, reps: int, load_reps: int, link: float | None
) -> dict:
    rank = dist.get_rank()
    shapes = model_shapes(dim, vocab)
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    results: dict = {}
    for layout in LAYOUTS:
        state = build_state(layout, shapes)
        save_s = save_rounds(root, layout, state, reps, None)
        load_s, correct = load_rounds(root, layout, state, load_reps)
        layout_out = {}
        for variant in VARIANTS:
            path = Path(root) / f"{layout}-{variant}"
            flags = torch.tensor(int(correct[variant]))
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            per_rank = bytes_per_rank(path)
            planned = planned_bytes_per_rank(path)
            mean = sum(per_rank) / WORLD
            layout_out[variant] = {
                "bytes_per_rank_mb": [round(b / 2**20, 1) for b in per_rank],
                "planned_per_rank_mb": [round(b / 2**20, 1) for b in planned],
                "max_mean": round(max(per_rank) / mean, 3),
                "max_mean_planned": round(max(planned) / (sum(planned) / WORLD), 3),
                "save_s": round(statistics.median(save_s[variant]), 3),
                "save_s_all": [round(t, 3) for t in save_s[variant]],
                "load_s": round(statistics.median(load_s[variant]), 3),
                "load_s_all": [round(t, 3) for t in load_s[variant]],
                "files": sum(1 for _ in path.iterdir()),
                "loads_equal": bool(flags),
            }
        results[layout] = layout_out
        if layout == "replicated" and link:
            linked = save_rounds(root, "linked", state, reps, link)
            results["linked"] = {v: round(statistics.median(t), 3) for v, t in linked.items()}
    raw: dict[int, list[float]] = {1: [], WORLD: []}
    for rep in range(reps + 1):
        for writers in (1, WORLD) if rep % 2 else (WORLD, 1):
            seconds = raw_write_seconds(Path(root), total, writers)
            if rep:
                raw[writers].append(seconds)
    data = os.urandom(64 << 20)
    t0 = time.perf_counter()
    zlib.crc32(data)
    crc_gbps = len(data) / (time.perf_counter() - t0) / 1e9
    out = {
        "model_mb": round(total / 2**20, 1),
        "crc32_gb_per_s": round(crc_gbps, 2),
        "raw_write_s": {w: round(statistics.median(t), 3) for w, t in raw.items()},
        **results,
    }
    return out if rank == 0 else {}


def _link_sweep(root: str, dim: int, vocab: int, reps: int, rates: tuple[float, ...]) -> dict:
    """Save seconds of the replicated layout per variant at each per-rank link rate (MB/s;
    0: no cap, the machine's own storage)."""
    state = build_state("replicated", model_shapes(dim, vocab))
    out = {}
    for rate in rates:
        rounds = save_rounds(root, f"sweep{rate:g}", state, reps, rate * 1e6 or None)
        out[rate] = {v: round(statistics.median(t), 3) for v, t in rounds.items()}
    return out if dist.get_rank() == 0 else {}


def plot_link_sweep(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capped = sorted(r for r in sweep if r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = {"lowest_rank": "stock, lowest rank", "dcp_default": "stock default", "ours": "ours"}
    for i, (variant, label) in enumerate(labels.items()):
        left.plot(capped, [sweep[r][variant] for r in capped], "-o", color=f"C{i}", label=label)
        if 0 in sweep:
            left.axhline(sweep[0][variant], color=f"C{i}", ls=":", lw=1)
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("per-rank link, MB/s (dotted: no cap, this machine's disk)")
    left.set_ylabel("save seconds (median)")
    left.set_title("replicated 344 MB, 4 ranks")
    left.legend(fontsize=8)
    speedup = [sweep[r]["lowest_rank"] / sweep[r]["ours"] for r in capped]
    ratio = [sweep[r]["ours"] / sweep[r]["dcp_default"] for r in capped]
    right.plot(capped, speedup, "-o", color="C2", label="ours: speedup vs lowest rank")
    right.plot(capped, ratio, "-s", color="C1", label="ours / stock default")
    if 0 in sweep:
        right.axhline(sweep[0]["lowest_rank"] / sweep[0]["ours"], color="C2", ls=":", lw=1)
        right.axhline(sweep[0]["ours"] / sweep[0]["dcp_default"], color="C1", ls=":", lw=1)
    right.axhline(1.5, color="grey", lw=0.8, ls="--")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xscale("log", base=2)
    right.set_xlabel("per-rank link, MB/s (dotted: no cap)")
    right.set_title("targets: speedup >= 1.5, ratio <= 1.0")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the simulation --------------------------------------------------------------------------


def real_model_shapes(models: tuple[str, ...] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """State dicts (meta tensors, bf16) of three real architectures, built from configs."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    configs = {
        "Llama-3-8B": LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
        ),
        "Mixtral-8x7B": MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "Qwen1.5-MoE-A2.7B": Qwen2MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=5632,
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
            num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
            num_experts=60, num_experts_per_tok=4,
        ),
    }  # fmt: skip
    unknown = set(models or ()) - set(configs)
    if unknown:
        raise ValueError(f"--sim-models: unknown {sorted(unknown)}; choose from {list(configs)}")
    out = {}
    for name, cfg in configs.items():
        if models and name not in models:
            continue
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        out[name] = dict(model.state_dict())
    return out


def _shard_item(fqn: str, t: torch.Tensor, shard: int, shards: int) -> WriteItem:
    """Rank ``shard``'s dim-0 chunk of ``t`` (FSDP2's uneven torch.chunk split)."""
    rows = t.shape[0] if t.dim() else 1
    per = -(-rows // shards)
    start = min(rows, shard * per)
    n = max(0, min(per, rows - start))
    offsets = torch.Size([start, *[0] * (t.dim() - 1)])
    sizes = torch.Size([n, *t.shape[1:]])
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=create_write_items(fqn, t)[0].tensor_data.properties,
            size=t.shape,
        ),
    )


def simulated_plans(sd: dict[str, torch.Tensor], world: int, shards: int) -> list[SavePlan]:
    """Local plans: fully replicated (shards=1) or HSDP with ``shards``-way sharding."""
    if shards == 1:
        items = [i for fqn, t in sd.items() for i in create_write_items(fqn, t)]
        return [SavePlan(list(items)) for _ in range(world)]
    per_shard = [
        [_shard_item(fqn, t, s, shards) for fqn, t in sd.items() if t.dim()] for s in range(shards)
    ]
    return [SavePlan(list(per_shard[r % shards])) for r in range(world)]


def imbalance(plans: list[SavePlan]) -> float:
    loads = [sum(item_nbytes(i) for i in p.items) for p in plans]
    return max(loads) / (sum(loads) / len(loads))


def lower_bound(plans: list[SavePlan]) -> float:
    """The best max/mean any planner can reach: items can only go to ranks that hold them.

    Under HSDP every copy of shard s sits in column s, so that column must write shard s:
    max/mean >= (largest column's bytes per rank) / (mean bytes per rank). Fully
    replicated plans form one column, where the bound is 1.
    """
    columns: dict[tuple, int] = {}
    holders: dict[tuple, set] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault((item.index.fqn, tuple(item.index.offset or ())), set()).add(rank)
    seen = set()
    for plan in plans:
        for item in plan.items:
            key = (item.index.fqn, tuple(item.index.offset or ()))
            if key in seen:
                continue
            seen.add(key)
            col = tuple(sorted(holders[key]))
            columns[col] = columns.get(col, 0) + item_nbytes(item)
    total = sum(columns.values())
    return max(b / len(col) for col, b in columns.items()) / (total / len(plans))


def simulate(worlds=SIM_WORLDS, models: tuple[str, ...] | None = None) -> dict:
    out: dict = {}
    for name, sd in real_model_shapes(models).items():
        for layout, shards in (("replicated", 1), ("hsdp8", 8)):
            rows = out.setdefault(
                f"{name} {layout}", {"dcp_default": {}, "ours": {}, "bound": {}, "seconds": {}}
            )
            for world in worlds:
                plans = simulated_plans(sd, world, shards)
                rows["dcp_default"][world] = round(imbalance(dedup_save_plans(plans)), 3)
                t0 = time.perf_counter()
                rows["ours"][world] = round(imbalance(spread_plans(plans)), 3)
                rows["seconds"][world] = round(time.perf_counter() - t0, 2)
                rows["bound"][world] = round(lower_bound(plans), 3)
    return out


def plot_simulation(sim: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, layout in zip(axes, ("replicated", "hsdp8"), strict=True):
        for i, (key, rows) in enumerate((k, v) for k, v in sim.items() if k.endswith(layout)):
            color = f"C{i}"
            worlds = list(rows["ours"])
            model = key.rsplit(" ", 1)[0]
            ax.plot(
                worlds,
                list(rows["dcp_default"].values()),
                "--o",
                color=color,
                label=f"{model} stock",
            )
            ax.plot(worlds, list(rows["ours"].values()), "-s", color=color, label=f"{model} ours")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("world size")
        ax.set_title("fully replicated" if layout == "replicated" else "HSDP, 8-way shard")
        ax.axhline(1.05, color="grey", lw=0.8)
    axes[0].set_ylabel("max / mean bytes written per rank")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the cluster lab -------------------------------------------------------------------------

LAB_VARIANTS = ("lowest_rank", "dcp_default", "ours")  # checksums on
# --storage s3: stock DCP's FsspecWriter/FsspecReader on s3fs, and our blob writer and reader
S3_VARIANTS = ("fsspec", "ours")
S3FS_ENV = "FSDP_EXT_S3FS_PATH"  # where s3fs (with its own botocore and boto3) is installed
S3FS_INSTALL = f"{sys.executable} -m pip install --target"
S3_TARGETS = {"s3_save_ratio_vs_fsspec": 0.8, "s3_load_ratio_vs_fsspec": 1.0}  # issue 39
LAB_MODEL = {"dim": 256, "vocab": 12288, "n_layers": 12}  # 66 MB; the embedding 1.5x a share


def _storage_bytes() -> tuple[int, int]:
    """(sent, received) on this node's storage link: its interface counters, read inside the
    node's namespace, count every byte this node wrote to or read from the shared storage.
    A lab node has three interfaces: loopback, its link to the other nodes, and this one."""
    links = [d for d in Path("/sys/class/net").iterdir() if d.name not in ("lo", FABRIC_DEVICE)]
    if len(links) != 1:
        raise RuntimeError(f"expected one storage link beside lo and {FABRIC_DEVICE}: {links}")
    stats = links[0] / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _lab_round(fn, key: int) -> tuple[float, list[list[int]]]:
    """Seconds of ``fn`` (slowest rank) and each rank's (sent, received) storage bytes."""
    before = _storage_bytes()
    seconds = timed(fn)
    after = _storage_bytes()
    moved = torch.tensor([after[key] - before[key]], dtype=torch.int64)
    gathered = [torch.zeros_like(moved) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, moved)
    return seconds, [int(g) for g in gathered]


def _s3_writer_and_planner(variant: str, location: str):
    """On S3: stock ``FsspecWriter`` (s3fs) with the stock planner, or our blob writer with
    ours. Stock gets ``sync_files=False``: with the default, every file's fsync falls back
    to ``os.sync()`` of the whole host (an S3 file has no descriptor), which only slows it;
    a finished S3 put is durable anyway."""
    if variant == "fsspec":
        fsspec_writer, _ = fsspec_writer_and_reader()
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        return fsspec_writer(location, sync_files=False, endpoint_url=endpoint), None
    return BlobStorageWriter(location, 1), SpreadSavePlanner()


def _s3_reader_and_planner(variant: str, location: str):
    if variant == "fsspec":
        _, fsspec_reader = fsspec_writer_and_reader()
        return fsspec_reader(location, endpoint_url=os.environ["AWS_ENDPOINT_URL"]), None
    return BlobStorageReader(location, 1), SafeLoadPlanner()


_S3FS_CHECK = """
import json, sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import boto3, botocore, s3fs
print(json.dumps({m.__name__: [m.__version__, m.__file__] for m in (s3fs, boto3, botocore)}))
"""


def check_s3fs(path: str | None, python: str = sys.executable) -> dict[str, str]:
    """The versions of s3fs, boto3 and botocore that the stock baseline's ranks will import
    (``path`` first on sys.path, when given); SystemExit with one line when they cannot."""
    proc = subprocess.run(
        [python, "-c", _S3FS_CHECK, path or ""], capture_output=True, text=True, timeout=300
    )
    where = f" from {path}" if path else " (no --s3fs-path, no $" + S3FS_ENV + ")"
    if proc.returncode != 0:
        cause = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"--storage s3: the stock baseline (FsspecWriter/FsspecReader) needs s3fs, which "
            f"does not import{where} ({cause}); install it apart from this venv (s3fs's "
            f"aiobotocore pins an older botocore than this venv's boto3): {S3FS_INSTALL} DIR "
            f"s3fs boto3, then pass --s3fs-path DIR or set {S3FS_ENV}=DIR"
        )
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    inside = {name: bool(path) and file.startswith(str(Path(path).resolve()))
              for name, (_, file) in found.items()}  # fmt: skip
    if path and inside["botocore"] != inside["boto3"]:
        raise SystemExit(
            f"--s3fs-path {path}: botocore {found['botocore'][0]} and boto3 "
            f"{found['boto3'][0]} come from different places ({found['botocore'][1]}, "
            f"{found['boto3'][1]}); install boto3 beside s3fs: {S3FS_INSTALL} {path} s3fs boto3"
        )
    return {name: version for name, (version, _) in found.items()}


def use_s3fs(path: str | None) -> dict[str, str]:
    """Put ``path`` first on this rank's sys.path (before any botocore is imported), so that
    s3fs, its aiobotocore and the botocore and boto3 they agree on are the ones loaded; both
    variants then share one botocore. Returns the versions loaded."""
    if path:
        if "botocore" in sys.modules:
            raise RuntimeError("use_s3fs must run before botocore is imported")
        sys.path.insert(0, path)
    import boto3
    import botocore
    import s3fs

    return {m.__name__: m.__version__ for m in (s3fs, boto3, botocore)}


def lab_worker(
    root: str,
    reps: int,
    layouts: tuple[str, ...],
    storage: str = "sshfs",
    s3fs_path: str | None = None,
) -> dict:
    """Run under torchrun on every node of a lab: save and load each layout with each
    writer on the shared storage (``root``: the shared directory, or an ``s3://`` location),
    median of ``reps`` rounds after a warm-up round, the writers interleaved and rotated."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shapes = model_shapes(LAB_MODEL["dim"], LAB_MODEL["vocab"], LAB_MODEL["n_layers"])
    out: dict = {"model_mb": round(sum(math.prod(s) * 4 for s in shapes.values()) / 2**20, 1)}
    if storage == "s3":
        out["versions"] = use_s3fs(s3fs_path)
        variants = S3_VARIANTS
        make_writer, make_reader = _s3_writer_and_planner, _s3_reader_and_planner
    else:
        variants = LAB_VARIANTS

        def make_writer(variant: str, location: str):
            return writer_and_planner(variant, Path(location))

        def make_reader(variant: str, location: str):
            return reader_and_planner(variant, Path(location))

    n = len(variants)
    for layout in layouts:
        state = build_state(layout, shapes)
        save_s: dict[str, list[float]] = {v: [] for v in variants}
        sent: dict[str, list[int]] = {}
        for rep in range(reps + 1):
            for variant in variants[rep % n :] + variants[: rep % n]:
                # a fresh path each round: nothing to remove, no cache of a removed directory
                writer, planner = make_writer(variant, f"{root}/{layout}-{variant}-{rep}")
                save = functools.partial(dcp.save, state, storage_writer=writer, planner=planner)
                seconds, per_rank = _lab_round(save, key=0)
                if rep:
                    save_s[variant].append(seconds)
                    sent[variant] = per_rank
        load_s: dict[str, list[float]] = {v: [] for v in variants}
        received: dict[str, list[int]] = {}
        exact = dict.fromkeys(variants, True)
        for rep in range(reps + 1):
            for variant in variants[rep % n :] + variants[: rep % n]:
                target = zeros_like_state(state)
                reader, planner = make_reader(variant, f"{root}/{layout}-{variant}-1")
                load = functools.partial(dcp.load, target, storage_reader=reader, planner=planner)
                seconds, per_rank = _lab_round(load, key=1)
                exact[variant] &= same(target, state)
                if rep:
                    load_s[variant].append(seconds)
                    received[variant] = per_rank
        flags = torch.tensor([int(exact[v]) for v in variants])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        out[layout] = {}
        for i, variant in enumerate(variants):
            row = {
                "save_s": round(statistics.median(save_s[variant]), 3),
                "save_s_all": [round(t, 3) for t in save_s[variant]],
                "load_s": round(statistics.median(load_s[variant]), 3),
                "load_s_all": [round(t, 3) for t in load_s[variant]],
                "storage_sent_mb_per_rank": [round(b / 2**20, 1) for b in sent[variant]],
                "storage_received_mb_per_rank": [round(b / 2**20, 1) for b in received[variant]],
                "loads_equal": bool(flags[i]),
            }
            if storage != "s3":
                path = Path(root) / f"{layout}-{variant}-1"
                row["disk_mb_per_rank"] = [round(b / 2**20, 1) for b in bytes_per_rank(path)]
            out[layout][variant] = row
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    return out


def plot_lab(result: dict, path: Path) -> None:
    """Save and load seconds of each writer, per link rate, for the first layout measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [str(r) for r in result["link_mbit"]]
    layout = next(k for k in result["per_rate"][rates[0]] if isinstance(k, str) and k in LAYOUTS)
    labels = {"lowest_rank": "stock, lowest rank", "dcp_default": "stock default", "ours": "ours"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(labels)
    for ax, what in zip(axes, ("save_s", "load_s"), strict=True):
        for i, (variant, label) in enumerate(labels.items()):
            values = [result["per_rate"][r][layout][variant][what] for r in rates]
            xs = [j + (i - 1) * width for j in range(len(rates))]
            ax.bar(xs, values, width, color=f"C{i}", label=label)
        ax.set_xticks(range(len(rates)), [f"{r} Mbit/s" for r in rates])
        ax.set_ylabel(f"{what[:4]} seconds (median)")
        ax.set_title(f"{what[:4]}, {layout} {result['model_mb']} MB, 4 nodes x 1 rank")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def s3_summary(
    args, nodes: int, rates: list[int], layouts: tuple[str, ...], per_rate: dict, versions
) -> dict:
    """The last line of ``--lab --storage s3``: our blob writer and reader against stock
    ``FsspecWriter``/``FsspecReader`` on s3fs, per rate and layout, the first rate's
    replicated layout (or the first layout) as the headline."""
    first = per_rate[str(rates[0])]
    head = first["replicated" if "replicated" in layouts else layouts[0]]
    storage_mb = {
        variant: {
            "save_sent_total": round(sum(head[variant]["storage_sent_mb_per_rank"]), 1),
            "save_sent_max_rank": max(head[variant]["storage_sent_mb_per_rank"]),
            "load_received_total": round(sum(head[variant]["storage_received_mb_per_rank"]), 1),
        }
        for variant in S3_VARIANTS
    }
    result = {
        "bench": "checkpoint_lab_s3",
        "nodes": nodes,
        "ranks_per_node": WORLD // nodes,
        "link_mbit": rates,
        "model_mb": first["model_mb"],
        "reps": args.lab_reps,
        "layouts": list(layouts),
        "versions": {"ranks": first["versions"], "checked": versions},
        "per_rate": per_rate,
        "storage_link_mb": storage_mb,
        "by_rate": {
            rate: {
                layout: {
                    "save_ratio_vs_fsspec": round(
                        m[layout]["ours"]["save_s"] / m[layout]["fsspec"]["save_s"], 2
                    ),
                    "load_ratio_vs_fsspec": round(
                        m[layout]["ours"]["load_s"] / m[layout]["fsspec"]["load_s"], 2
                    ),
                }
                for layout in layouts
            }
            for rate, m in per_rate.items()
        },
        "loads_equal": all(
            row["loads_equal"]
            for m in per_rate.values()
            for layout in layouts
            for row in m[layout].values()
        ),
        "targets": S3_TARGETS,
        "s3_save_ratio_vs_fsspec": round(head["ours"]["save_s"] / head["fsspec"]["save_s"], 2),
        "s3_load_ratio_vs_fsspec": round(head["ours"]["load_s"] / head["fsspec"]["load_s"], 2),
    }
    return result


def lab_main(args) -> dict:
    """Build a lab (4 ranks on ``--lab-nodes`` nodes, each node's links capped, the storage
    node serving sshfs or S3), run :func:`lab_worker` in it once per link rate, report the
    ratios."""
    reason = unavailable_reason(storage=args.storage)
    if reason is not None:
        raise SystemExit(f"--lab: {reason}")
    versions = check_s3fs(args.s3fs_path) if args.storage == "s3" else None
    nodes = args.lab_nodes
    rates = [int(r) for r in args.lab_link.split(",")]
    layouts = ("replicated",) if args.quick else tuple(args.lab_layouts.split(","))
    per_rate: dict[str, dict] = {}
    with Cluster(
        nodes=nodes,
        ranks_per_node=WORLD // nodes,
        link=f"{rates[0]}mbit",
        timeout=3000,
        storage=args.storage,
    ) as lab:
        if args.lab_echo:
            print(f"lab: {lab.describe()}", file=sys.stderr, flush=True)
        for rate in rates:
            lab.set_link(f"{rate}mbit")
            lab.set_storage_link(f"{rate}mbit")
            worker = [str(Path(__file__).resolve()), "--lab-worker"]
            worker += [f"{lab.storage_location}/ckpt-{rate}", "--lab-reps", str(args.lab_reps)]
            worker += ["--lab-layouts", ",".join(layouts), "--storage", args.storage]
            if args.s3fs_path:
                worker += ["--s3fs-path", args.s3fs_path]
            job = lab.run(worker, echo=sys.stderr if args.lab_echo else None)
            measured = job.last_json()
            if job.returncode != 0 or measured is None:
                others = "".join(
                    f"\nrank {r}'s stderr:\n{err[-1500:]}"
                    for r, err in enumerate(job.rank_stderr)
                    if r and err.strip()
                )
                raise SystemExit(
                    f"--lab: the job at {rate} Mbit/s failed (exit {job.returncode}, timed out "
                    f"{job.timed_out}):\n{job.output[-4000:]}{others[:4000]}"
                )
            measured["job_s"] = round(job.seconds, 1)
            measured["link_bytes_mb"] = [
                {k: round(v / 2**20, 1) for k, v in b.as_dict().items()} for b in job.link_bytes
            ]
            per_rate[str(rate)] = measured
            print(f"lab {rate} Mbit/s: " + json.dumps(measured), flush=True)
    if args.storage == "s3":
        result = s3_summary(args, nodes, rates, layouts, per_rate, versions)
        print(json.dumps(result), flush=True)
        return result
    head = per_rate[str(rates[0])]["replicated" if "replicated" in layouts else layouts[0]]
    result = {
        "bench": "checkpoint_lab",
        "nodes": nodes,
        "ranks_per_node": WORLD // nodes,
        "link_mbit": rates,
        "model_mb": per_rate[str(rates[0])]["model_mb"],
        "reps": args.lab_reps,
        "per_rate": per_rate,
        "lab_save_speedup_vs_lowest_rank": round(
            head["lowest_rank"]["save_s"] / head["ours"]["save_s"], 2
        ),
        "lab_save_ratio_vs_dcp_default": round(
            head["ours"]["save_s"] / head["dcp_default"]["save_s"], 2
        ),
        "lab_load_ratio_vs_dcp_default": round(
            head["ours"]["load_s"] / head["dcp_default"]["load_s"], 2
        ),
        "by_rate": {
            rate: {
                layout: {
                    "save_speedup_vs_lowest_rank": round(
                        m[layout]["lowest_rank"]["save_s"] / m[layout]["ours"]["save_s"], 2
                    ),
                    "save_ratio_vs_dcp_default": round(
                        m[layout]["ours"]["save_s"] / m[layout]["dcp_default"]["save_s"], 2
                    ),
                    "load_ratio_vs_dcp_default": round(
                        m[layout]["ours"]["load_s"] / m[layout]["dcp_default"]["load_s"], 2
                    ),
                }
                for layout in layouts
            }
            for rate, m in per_rate.items()
        },
    }
    if args.plot:
        plot_lab(result, DOCS / "checkpoint_lab.png")
    print(json.dumps(result), flush=True)
    return result


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~90 MB model, one load per variant")
    p.add_argument("--simulate", action="store_true", help="planner simulation only")
    p.add_argument(
        "--link-mbps",
        type=float,
        default=200.0,
        help="also save the replicated layout with each rank's writes capped at this many "
        "MB/s, a modelled per-rank link to storage (0: skip)",
    )
    p.add_argument(
        "--link-sweep",
        default="",
        help="only this: the replicated layout saved at each of these per-rank link rates "
        "(comma-separated MB/s, 0 = no cap), plotted to docs/checkpoint_link.png",
    )
    p.add_argument("--sim-worlds", default=",".join(map(str, SIM_WORLDS)))
    p.add_argument("--sim-models", default="", help="comma-separated subset (default: all)")
    p.add_argument("--plot", default=str(DOCS / "checkpoint_sim.png"), help="'' to skip")
    p.add_argument(
        "--lab",
        action="store_true",
        help="only this: save and load in the cluster lab (4 ranks, sshfs shared storage, "
        "per-node link caps); needs root",
    )
    p.add_argument("--lab-nodes", type=int, default=4, choices=(2, 4))
    p.add_argument(
        "--lab-link", default="200", help="per-node link rates, Mbit/s (comma-separated)"
    )
    p.add_argument("--lab-reps", type=int, default=3, help="timed rounds (median), >= 1")
    p.add_argument("--lab-layouts", default="replicated,hsdp,fsdp")
    p.add_argument("--lab-echo", action="store_true", help="stream node 0's console")
    p.add_argument(
        "--storage",
        choices=("sshfs", "s3"),
        default="sshfs",
        help="with --lab: what the storage node serves. s3: SeaweedFS, ours against stock "
        "FsspecWriter/FsspecReader on s3fs (needs --s3fs-path)",
    )
    p.add_argument(
        "--s3fs-path",
        default=os.environ.get(S3FS_ENV) or None,
        help=f"with --storage s3: a directory holding s3fs and the boto3 and botocore it agrees "
        f"with ({S3FS_INSTALL} DIR s3fs boto3), put first on the lab ranks' sys.path; "
        f"default ${S3FS_ENV}",
    )
    p.add_argument("--lab-worker", default="", help=argparse.SUPPRESS)  # inside the lab
    args = p.parse_args(argv)
    worlds = tuple(int(w) for w in args.sim_worlds.split(","))
    if args.lab_reps < 1:
        p.error(f"--lab-reps must be >= 1, got {args.lab_reps}")
    bad = set(args.lab_layouts.split(",")) - set(LAYOUTS)
    if bad:
        p.error(f"--lab-layouts: unknown {sorted(bad)}; choose from {list(LAYOUTS)}")
    if args.storage != "sshfs" and not (args.lab or args.lab_worker):
        p.error(f"--storage {args.storage}: only with --lab (the lab's storage node serves it)")
    if args.lab_worker:
        return lab_worker(
            args.lab_worker,
            args.lab_reps,
            tuple(args.lab_layouts.split(",")),
            args.storage,
            args.s3fs_path,
        )
    if args.lab:
        return lab_main(args)

    if args.link_sweep:
        rates = tuple(float(r) for r in args.link_sweep.split(","))
        dim, vocab = (256, 16384) if args.quick else (512, 32768)
        with tempfile.TemporaryDirectory(
            prefix="fsdp_ext_ckpt_bench_", dir=os.environ.get("CKPT_BENCH_DIR")
        ) as root:
            sweep = run_distributed(_link_sweep, WORLD, root, dim, vocab, 3, rates, timeout=3000)[0]
        if args.plot:
            plot_link_sweep(sweep, DOCS / "checkpoint_link.png")
        result = {
            "bench": "checkpoint_link_sweep",
            "save_s": {f"{r:g}": v for r, v in sweep.items()},
            "save_speedup_vs_lowest_rank": {
                f"{r:g}": round(v["lowest_rank"] / v["ours"], 2) for r, v in sweep.items()
            },
            "save_ratio_vs_dcp_default": {
                f"{r:g}": round(v["ours"] / v["dcp_default"], 2) for r, v in sweep.items()
            },
        }
        print(json.dumps(result), flush=True)
        return result

    result: dict = {"bench": "checkpoint"}
    if not args.simulate:
        dim, vocab = (256, 16384) if args.quick else (512, 32768)
        with tempfile.TemporaryDirectory(
            prefix="fsdp_ext_ckpt_bench_", dir=os.environ.get("CKPT_BENCH_DIR")
        ) as root:
            measured = run_distributed(
                _measure,
                WORLD,
                root,
                dim,
                vocab,
                3 if args.quick else 5,
                3 if args.quick else 5,
                args.link_mbps * 1e6,
                timeout=3000,
            )[0]
        for layout in LAYOUTS:
            print(f"{layout}: " + json.dumps(measured[layout]), flush=True)
        rep = measured["replicated"]
        result["layouts"] = {
            layout: {
                v: {
                    k: measured[layout][v][k]
                    for k in (
                        "bytes_per_rank_mb",
                        "planned_per_rank_mb",
                        "max_mean",
                        "max_mean_planned",
                        "save_s",
                        "load_s",
                        "files",
                        "loads_equal",
                    )
                }
                for v in VARIANTS
            }
            for layout in LAYOUTS
        }
        result["model_mb"] = measured["model_mb"]
        result["imbalance_ours"] = max(measured[layout]["ours"]["max_mean"] for layout in LAYOUTS)
        result["imbalance_dcp_default"] = rep["dcp_default"]["max_mean"]
        result["imbalance_lowest_rank"] = rep["lowest_rank"]["max_mean"]
        result["save_speedup_vs_lowest_rank"] = round(
            rep["lowest_rank"]["save_s"] / rep["ours"]["save_s"], 2
        )
        result["save_ratio_vs_dcp_default"] = round(
            rep["ours"]["save_s"] / rep["dcp_default"]["save_s"], 2
        )
        # load seconds of ours against the stock default's, each read by its own reader
        result["load_ratio_vs_dcp_default"] = {
            layout: round(
                measured[layout]["ours"]["load_s"] / measured[layout]["dcp_default"]["load_s"], 2
            )
            for layout in LAYOUTS
        }
        result["checksum_cost"] = round(rep["ours"]["save_s"] / rep["ours_nocrc"]["save_s"] - 1, 3)
        raw = measured["raw_write_s"]
        # the most any spreading of writes can gain over one writer on this machine's storage
        result["raw_write_speedup_4_vs_1"] = round(raw[1] / raw[WORLD], 2)
        if "linked" in measured:
            linked = measured["linked"]
            print("linked: " + json.dumps(linked), flush=True)
            result["linked"] = {
                "mb_per_s_per_rank": args.link_mbps,
                "save_s": linked,
                "save_speedup_vs_lowest_rank": round(linked["lowest_rank"] / linked["ours"], 2),
                "save_ratio_vs_dcp_default": round(linked["ours"] / linked["dcp_default"], 2),
            }
        result["crc32_gb_per_s"] = measured["crc32_gb_per_s"]
        result["crc32_share_of_save"] = round(
            measured["model_mb"]
            * 2**20
            / (measured["crc32_gb_per_s"] * 1e9)
            / WORLD
            / rep["ours"]["save_s"],
            3,
        )
    sim = simulate(worlds, tuple(m for m in args.sim_models.split(",") if m) or None)
    for key, rows in sim.items():
        print(f"sim {key}: stock {rows['dcp_default']} ours {rows['ours']} bound {rows['bound']}")
    if args.plot:
        plot_simulation(sim, Path(args.plot))
    result["sim"] = {
        k: {key: v[key] for key in ("dcp_default", "ours", "bound")} for k, v in sim.items()
    }
    replicated = [v for k, v in sim.items() if k.endswith("replicated")]
    # the simulation: fully replicated plans (the bound is 1 there)
    result["sim_max_imbalance_ours"] = max(max(v["ours"].values()) for v in replicated)
    result["sim_max_imbalance_dcp_default"] = max(
        max(v["dcp_default"].values()) for v in replicated
    )
    # every layout, HSDP too: how far above the best any planner could do
    result["sim_max_over_bound_ours"] = round(
        max(v["ours"][w] / v["bound"][w] for v in sim.values() for w in v["ours"]), 3
    )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    teardown_on_termination()  # SIGTERM tears the lab down, as Ctrl-C does
    main()
