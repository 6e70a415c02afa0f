"""Kill a blob checkpoint operation before its k-th write request, for each k; print JSON.

``python s3_kill_sweep.py LOCATION OP=KS...`` (OP: save, overwrite or prune; KS: "all",
comma-separated request numbers, or "pivot": the requests just before and just after the
catalog commit). Each OP first runs to the end once, which lists its requests. For each k,
on a fresh location: publish step 1 (state A) and step 2 (state B), then fork a child that
runs the operation through a store that SIGKILLs its own process before its k-th PUT or
DELETE (the requests counted in the child, against the real server). Then, in this
process: every published step must load whole and equal what was saved as that step (never
a mix); one more save must publish, and afterwards the bucket must hold nothing but the
catalog, the owner records and the objects of published steps. Prints one JSON line:
``{OP: {"requests": [...], "catalog_at": K, "results": {k: "old" | "new"}}}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp

import fsdp_ext.checkpoint.blob_writer as blob_writer
from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.catalog import CATALOG_KEY, read_catalog, remove_step
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.planner import SpreadSavePlanner

WRITES = ("put", "put_if_absent", "replace_if", "delete")


class KillingStore:
    """Wraps a store: counts write requests, and kills the process before the k-th."""

    def __init__(self, inner, kill_at: int | None):
        self.inner, self.kill_at, self.requests = inner, kill_at, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in WRITES:
            return attr

        def request(key, *args):
            self.requests.append(f"{name} {key}")
            if self.kill_at is not None and len(self.requests) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return attr(key, *args)

        return request


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layers.{i}.w": torch.randn(64, 32, generator=gen) for i in range(2)},
        "norm": torch.randn(32, generator=gen),
        "step": seed,
    }


def empty() -> dict:
    return {
        "model": {f"layers.{i}.w": torch.zeros(64, 32) for i in range(2)},
        "norm": torch.zeros(32),
        "step": -1,
    }


def save(location: str, step: int, seed: int) -> None:
    writer = blob_writer.BlobStorageWriter(location, step, min_file_bytes=0, thread_count=1)
    dcp.save(state(seed), storage_writer=writer, planner=SpreadSavePlanner())


def operation(location: str, op: str) -> None:
    if op == "prune":
        remove_step(blob_store_for(location), 1, generation=None)
    else:
        save(location, 3 if op == "save" else 2, 30)


def loads_as(location: str, step: int) -> int:
    """The seed of the state ``step`` loads as; raises if it does not load whole."""
    out = empty()
    dcp.load(out, storage_reader=BlobStorageReader(location, step))
    for seed in (step, 30):
        want = state(seed)
        same = all(torch.equal(out["model"][k], want["model"][k]) for k in want["model"])
        if out["step"] == seed and same and torch.equal(out["norm"], want["norm"]):
            return seed
    raise AssertionError(f"{location} step {step}: loaded a mix of saves (step {out['step']})")


def run_one(location: str, op: str, kill_at: int | None) -> tuple[str, list[str]]:
    save(location, 1, 1)
    save(location, 2, 2)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the operation through the killing store
        os.close(read)
        stores = []
        real = blob_writer.blob_store_for

        def killing(loc):
            stores.append(KillingStore(real(loc), kill_at))
            return stores[-1]

        blob_writer.blob_store_for = killing
        import fsdp_ext.checkpoint.catalog as catalog_module

        if op == "prune":
            store = killing(location)
            catalog_module.remove_step(store, 1, generation=None)
        else:
            operation(location, op)
        os.write(write, json.dumps([r for s in stores for r in s.requests]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        done = pipe.read()
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        raise AssertionError(f"k={kill_at}: the child failed (status {status})")
    store = blob_store_for(location)
    catalog, _ = read_catalog(store)
    steps = sorted(catalog.steps)
    seeds = {s: loads_as(location, s) for s in steps}
    old = {1: 1, 2: 2}
    new = {"save": {1: 1, 2: 2, 3: 30}, "overwrite": {1: 1, 2: 30}, "prune": {2: 2}}[op]
    outcome = "old" if seeds == old else "new" if seeds == new else None
    if outcome is None:
        raise AssertionError(f"k={kill_at}: published steps load as {seeds}")
    # the next save sweeps whatever the killed operation left
    save(location, 9, 9)
    catalog, _ = read_catalog(store)
    live = set(catalog.steps.values())
    leaked = [
        k
        for k in store.list("")
        if k != CATALOG_KEY
        and not k.startswith(".owner/")
        and "/".join(k.split("/")[:2]) not in live
    ]
    if leaked:
        raise AssertionError(f"k={kill_at}: left after the next save: {leaked}")
    return outcome, json.loads(done) if done else []


def sweep(location: str, specs: list[str]) -> dict:
    """Each ``OP=KS`` of ``specs`` on its own locations under ``location`` (see above)."""
    out = {}
    for spec in specs:
        op, ks = spec.split("=")
        outcome, requests = run_one(f"{location}/{op}-probe", op, None)
        assert outcome == "new", f"{op} ran to the end but published {outcome}"
        catalog_at = 1 + next(i for i, r in enumerate(requests) if CATALOG_KEY in r)
        if ks == "all":
            chosen = list(range(1, len(requests) + 1))
        elif ks == "pivot":  # the commit request, and the one after it (if any)
            chosen = sorted({catalog_at, min(catalog_at + 1, len(requests))})
        else:
            chosen = [int(k) for k in ks.split(",")]
        results = {k: run_one(f"{location}/{op}-k{k}", op, k)[0] for k in chosen}
        out[op] = {"requests": requests, "catalog_at": catalog_at, "results": results}
    return out


def main() -> None:
    print(json.dumps(sweep(sys.argv[1], sys.argv[2:])))


if __name__ == "__main__":
    main()
