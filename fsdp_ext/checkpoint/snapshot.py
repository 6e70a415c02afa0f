"""In-memory snapshots of every rank's shards, with a copy on the next node (Gemini, SOSP'23).

Every few steps each rank writes its own shards (model, optimizer, any ``Stateful`` extras:
the step's schedule, RNG streams) into its node's RAM, ``/dev/shm/fsdp_ext-snapshots-<job>/
step-N/rank-R.snap``, which outlives a worker restart, and sends the same bytes over the
process group to the rank with its local rank on the next node (node i's copy goes to node
(i + 1) % N, Gemini's ring placement), which keeps it in its own RAM. A restart loads the
freshest step for which every rank's file is found intact somewhere (its own node, else the
peer's copy, sent back over the process group); a node that was lost gets its shards from
its peer. Disk checkpoints stay the source of truth: a snapshot is only taken when it is
newer than the newest disk checkpoint, and anything missing, torn or of another world size
falls back to the disk.

Integrity, as on disk: each file is written to a temporary name and renamed into place
(whole or absent); its first line holds its step, rank, world size, payload length and
SHA-256, and a file that does not match them is skipped with a warning, never loaded.
Snapshots hold this rank's local shards: they load into the same world size and sharding
only (a resume on fewer nodes loads the disk checkpoint, which DCP reshards).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.storage import CheckpointStorage

__all__ = ["SNAPSHOT_ROOT_ENV", "Snapshots", "read_snapshot", "write_snapshot"]

SNAPSHOT_ROOT_ENV = "FSDP_EXT_SNAPSHOT_ROOT"  # default /dev/shm: the node's RAM
_MAGIC = "fsdp_ext-snapshot/1"


class TornSnapshotError(ValueError):
    """A snapshot file that is not whole: skipped, never loaded."""


def _to_local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local(v) for v in value)
    return value


def _fill(template: Any, saved: Any, where: str) -> Any:
    """``saved`` (local tensors) poured into ``template`` (this run's state dict) in place,
    as DCP loads: DTensors keep their mesh and placement, tensors their storage."""
    if isinstance(template, DTensor):
        local = template.to_local()
        if local.shape != saved.shape:
            raise ValueError(f"{where}: shard shape {tuple(saved.shape)} != {tuple(local.shape)}")
        local.copy_(saved)
        return template
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        if template.shape == saved.shape and template.dtype == saved.dtype:
            template.copy_(saved)
            return template
        return saved.clone()
    if isinstance(template, dict) and isinstance(saved, dict):
        return {
            k: _fill(template[k], v, f"{where}.{k}") if k in template else v
            for k, v in saved.items()
        }
    sequences = isinstance(template, (list, tuple)) and isinstance(saved, (list, tuple))
    if sequences and len(template) == len(saved):
        return type(saved)(
            _fill(t, s, f"{where}[{i}]")
            for i, (t, s) in enumerate(zip(template, saved, strict=True))
        )
    return saved


def write_snapshot(fs: CheckpointStorage, path: Path, header: dict, payload: bytes) -> None:
    """Header line + payload, written aside and renamed into place (whole or absent)."""
    meta = {**header, "magic": _MAGIC, "size": len(payload)}
    meta["sha256"] = hashlib.sha256(payload).hexdigest()
    fs.makedirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with fs.open_write(tmp) as f:
        f.write(json.dumps(meta).encode() + b"\n")
        f.write(payload)
    fs.rename(tmp, path)


def read_snapshot(blob: bytes) -> tuple[dict, bytes]:
    """(header, payload) of a snapshot file's bytes; TornSnapshotError unless it is whole."""
    line, sep, payload = blob.partition(b"\n")
    try:
        meta = json.loads(line) if sep else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("magic") != _MAGIC:
        raise TornSnapshotError("no snapshot header")
    if len(payload) != meta.get("size"):
        raise TornSnapshotError(f"{len(payload)} payload bytes, the header says {meta['size']}")
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        raise TornSnapshotError("payload SHA-256 differs from the header's")
    return meta, payload


def _step_name(step: int) -> str:
    return f"step-{step:07d}"


class Snapshots:
    """One job's in-memory snapshots, seen from this rank (construct on every rank).

    ``state``: what a checkpoint saves (``Checkpointer.state``). ``job``: a name the
    job's restarts share and other jobs do not (e.g. a hash of its checkpoint root).
    ``ranks_per_node``: ranks sharing a node's RAM (torchrun's ``LOCAL_WORLD_SIZE``).
    ``keep``: newest steps kept per node (2: a step being written never leaves a node
    without a whole one). ``fs``: the storage of the node's RAM (a local filesystem).
    """

    def __init__(
        self,
        state: dict[str, Stateful],
        *,
        job: str,
        ranks_per_node: int,
        root: str | os.PathLike | None = None,
        keep: int = 2,
        fs: CheckpointStorage | None = None,
    ) -> None:
        self.state = state
        self.fs = fs or LocalStorage()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if ranks_per_node < 1 or self.world % ranks_per_node:
            raise ValueError(
                f"ranks_per_node must divide the world size {self.world}, got {ranks_per_node}"
            )
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.ranks_per_node = ranks_per_node
        self.nodes = self.world // ranks_per_node
        self.keep = keep
        root = Path(root or os.environ.get(SNAPSHOT_ROOT_ENV) or "/dev/shm")
        self.dir = root / f"fsdp_ext-snapshots-{job}"
        self.recovered: list[int] = []  # ranks the last restore sent their peer's copy

    @property
    def peer(self) -> int | None:
        """The rank on the next node that keeps this rank's copy (None on one node)."""
        if self.nodes == 1:
            return None
        return (self.rank + self.ranks_per_node) % self.world

    @property
    def _from(self) -> int:
        return (self.rank - self.ranks_per_node) % self.world

    def _file(self, step: int, owner: int) -> Path:
        return self.dir / _step_name(step) / f"rank-{owner:05d}.snap"

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> None:
        """This rank's shards into its node's RAM and its peer's (collective)."""
        buffer = io.BytesIO()
        torch.save({k: _to_local(v.state_dict()) for k, v in self.state.items()}, buffer)
        payload = buffer.getvalue()
        header = {"step": step, "rank": self.rank, "world": self.world}
        write_snapshot(self.fs, self._file(step, self.rank), header, payload)
        if self.peer is not None:
            blob = self.fs.read_bytes(self._file(step, self.rank))
            received = self._exchange(blob, send_to=self.peer, recv_from=self._from)
            try:
                meta, body = read_snapshot(received)
                write_snapshot(self.fs, self._file(step, meta["rank"]), _header(meta), body)
            except TornSnapshotError as exc:
                warnings.warn(f"snapshot of rank {self._from} at step {step}: {exc}", stacklevel=2)
        self._prune()

    def _exchange(self, blob: bytes, *, send_to: int, recv_from: int) -> bytes:
        size = torch.tensor([len(blob)], dtype=torch.int64)
        their = torch.zeros(1, dtype=torch.int64)
        for work in (dist.isend(size, send_to), dist.irecv(their, recv_from)):
            work.wait()
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        got = torch.empty(int(their), dtype=torch.uint8)
        for work in (dist.isend(data, send_to), dist.irecv(got, recv_from)):
            work.wait()
        return got.numpy().tobytes()

    def _prune(self) -> None:
        steps = sorted(self._steps_here())
        for step in steps[: -self.keep]:
            self.fs.remove_tree(self.dir / _step_name(step), missing_ok=True)

    def _steps_here(self) -> list[int]:
        try:
            names = self.fs.listdir(self.dir)
        except FileNotFoundError:
            return []
        return [int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()]

    # ------------------------------------------------------------------ restore
    def _intact_here(self) -> dict[tuple[int, int], int]:
        """{(step, owner rank): file size} of whole files of this world in this node's RAM."""
        found = {}
        for step in self._steps_here():
            folder = self.dir / _step_name(step)
            try:
                names = self.fs.listdir(folder)
            except FileNotFoundError:  # pruned meanwhile
                continue
            for name in names:
                if not (name.startswith("rank-") and name.endswith(".snap")):
                    continue
                try:
                    blob = self.fs.read_bytes(folder / name)
                    meta, _ = read_snapshot(blob)
                except (OSError, TornSnapshotError) as exc:
                    warnings.warn(f"snapshot {folder / name} skipped: {exc}", stacklevel=3)
                    continue
                if meta.get("world") == self.world and meta.get("step") == step:
                    found[(step, int(meta["rank"]))] = len(blob)
        return found

    def restore(self, at_least: int = 0) -> int | None:
        """Load the freshest step >= ``at_least`` whose every rank's file is intact on
        some node (collective); its step, or None (then load the disk checkpoint)."""
        mine = self._intact_here()
        everyone: list[dict] = [{}] * self.world
        dist.all_gather_object(everyone, mine)
        holders: dict[tuple[int, int], int] = {}  # (step, owner) -> who reads or sends it
        for rank, found in enumerate(everyone):
            for key in found:
                if key[1] == rank:  # the owner's own node has it
                    holders[key] = rank
                else:
                    holders.setdefault(key, rank)
        whole = [
            s
            for s in {s for s, _ in holders}
            if s >= at_least and all((s, r) in holders for r in range(self.world))
        ]
        if not whole:
            return None
        chosen = max(whole)
        self.recovered = [r for r in range(self.world) if holders[(chosen, r)] != r]
        blob = self._gather_own(chosen, holders, everyone)
        _, payload = read_snapshot(blob)
        saved = torch.load(io.BytesIO(payload), weights_only=True)
        for name, obj in self.state.items():
            obj.load_state_dict(_fill(obj.state_dict(), saved[name], name))
        return chosen

    def _gather_own(self, step: int, holders: dict, everyone: list[dict]) -> bytes:
        """This rank's file of ``step``: from its node's RAM, else sent by the rank that
        holds the copy (its peer); a received copy is kept in this node's RAM again."""
        works, outgoing = [], []  # outgoing: buffers alive until sent
        for owner in range(self.world):
            holder = holders[(step, owner)]
            if holder != owner and self.rank == holder:
                data = torch.frombuffer(
                    bytearray(self.fs.read_bytes(self._file(step, owner))), dtype=torch.uint8
                )
                outgoing.append(data)
                works.append(dist.isend(data, owner))
        got = None
        holder = holders[(step, self.rank)]
        if holder != self.rank:
            got = torch.empty(everyone[holder][(step, self.rank)], dtype=torch.uint8)
            works.append(dist.irecv(got, holder))
        for work in works:
            work.wait()
        if got is None:
            return self.fs.read_bytes(self._file(step, self.rank))
        blob = got.numpy().tobytes()
        meta, payload = read_snapshot(blob)
        write_snapshot(self.fs, self._file(step, self.rank), _header(meta), payload)
        return blob

    # ------------------------------------------------------------------ end
    def clear(self) -> None:
        """Remove this node's snapshots of the job (collective: after every rank is done
        with them, the node's local rank 0 removes the directory)."""
        dist.barrier()
        if self.rank % self.ranks_per_node == 0:
            self.fs.remove_tree(self.dir, missing_ok=True)
        dist.barrier()


def _header(meta: dict) -> dict:
    return {k: meta[k] for k in ("step", "rank", "world")}
