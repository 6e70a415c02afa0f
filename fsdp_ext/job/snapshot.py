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

RAM is small and shared: a snapshot that does not fit on every rank's node is skipped on all
of them (one warning naming the step, the bytes needed and the bytes free), and training and
disk checkpoints go on. A job's directory records its checkpoint root (``job.json``), so that
``python -m fsdp_ext.job clean-snapshots`` can remove what a job that failed for good
left in a node's RAM once that job's owner is provably gone.
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

from fsdp_ext.checkpoint.location import blob_store_for, is_object_store, posix_storage
from fsdp_ext.checkpoint.steps import step_name
from fsdp_ext.checkpoint.storage import CheckpointStorage, is_out_of_space
from fsdp_ext.job.blob_ownership import blob_owner_gone
from fsdp_ext.job.ownership import owner_gone

__all__ = [
    "SNAPSHOT_ROOT_ENV",
    "Snapshots",
    "clean_snapshots",
    "job_name",
    "read_snapshot",
    "snapshot_dir",
    "write_snapshot",
]

SNAPSHOT_ROOT_ENV = "FSDP_EXT_SNAPSHOT_ROOT"  # default /dev/shm: the node's RAM
_MAGIC = "fsdp_ext-snapshot/1"
_PREFIX = "fsdp_ext-snapshots-"
_JOB_RECORD = "job.json"  # {"checkpoint_root": ...}: whose snapshots these are


def job_name(checkpoint_root: str | os.PathLike) -> str:
    """The snapshot name of the job that owns ``checkpoint_root``: its restarts and every
    node share it, other jobs do not (an ``s3://`` location is the same string everywhere;
    a path is made absolute)."""
    root = os.fspath(checkpoint_root)
    name = root if is_object_store(root) else os.path.abspath(root)
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _owner_gone(root: str) -> str | None:
    if is_object_store(root):
        from fsdp_ext.checkpoint.blob import BlobError

        try:
            return blob_owner_gone(blob_store_for(root))
        except (BlobError, OSError, ValueError):
            return None  # the store cannot tell: keep them
    return owner_gone(root)


def snapshot_dir(job: str, root: str | os.PathLike | None = None) -> Path:
    """Where this node keeps job ``job``'s snapshots (``$FSDP_EXT_SNAPSHOT_ROOT``, else
    /dev/shm)."""
    return Path(root or os.environ.get(SNAPSHOT_ROOT_ENV) or "/dev/shm") / f"{_PREFIX}{job}"


def clean_snapshots(
    root: str | os.PathLike | None = None, fs: CheckpointStorage | None = None
) -> list[tuple[Path, str]]:
    """Remove this node's snapshots of jobs whose owner is provably gone (released, or its
    process on this machine exited); keep the others. Returns (directory, what was done)."""
    fs = posix_storage(fs)
    base = snapshot_dir("", root).parent
    done = []
    for name in fs.listdir(base) if fs.kind(base) != "missing" else []:
        if not name.startswith(_PREFIX):
            continue
        path = base / name
        try:
            owner_root = json.loads(fs.read_bytes(path / _JOB_RECORD))["checkpoint_root"]
        except (OSError, ValueError, KeyError, TypeError):
            owner_root = None
        why = "no job record" if owner_root is None else _owner_gone(owner_root)
        if why is None:
            done.append((path, f"kept: the job owning {owner_root} may be alive"))
            continue
        fs.remove_tree(path, missing_ok=True)
        done.append((path, f"removed ({why})"))
    return done


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


def snapshot_bytes(header: dict, payload: bytes) -> bytes:
    """A snapshot file's bytes: its header line, then the payload."""
    meta = {**header, "magic": _MAGIC, "size": len(payload)}
    meta["sha256"] = hashlib.sha256(payload).hexdigest()
    return json.dumps(meta).encode() + b"\n" + payload


def write_snapshot(fs: CheckpointStorage, path: Path, header: dict, payload: bytes) -> None:
    """Header line + payload, written aside and renamed into place (whole or absent)."""
    _write_whole(fs, path, snapshot_bytes(header, payload))


def _write_whole(fs: CheckpointStorage, path: Path, blob: bytes) -> None:
    fs.makedirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with fs.open_write(tmp) as f:
            f.write(blob)
        fs.rename(tmp, path)
    except OSError:
        if fs.kind(tmp) != "missing":
            fs.unlink(tmp)  # a full RAM disk keeps nothing of a snapshot that did not fit
        raise


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
        checkpoint_root: str | os.PathLike | None = None,
    ) -> None:
        self.state = state
        self.fs = posix_storage(fs)
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
        self.dir = snapshot_dir(job, root)
        self.checkpoint_root = None if checkpoint_root is None else str(checkpoint_root)
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
        return self.dir / step_name(step) / f"rank-{owner:05d}.snap"

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> bool:
        """This rank's shards into its node's RAM and its peer's (collective). Skipped on
        every rank, with one warning, when some node lacks the room; returns whether taken."""
        buffer = io.BytesIO()
        torch.save({k: _to_local(v.state_dict()) for k, v in self.state.items()}, buffer)
        blob = snapshot_bytes(
            {"step": step, "rank": self.rank, "world": self.world}, buffer.getvalue()
        )
        need = len(blob) * (1 if self.peer is None else 2)  # its own copy and its peer's
        free = self._free_bytes()
        fits = torch.tensor([1 if free >= need + len(blob) else 0], dtype=torch.int64)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # a partial snapshot restores nothing
        taken = bool(fits.item())
        if taken:
            taken = self._keep(self._file(step, self.rank), blob, step, need, free)
        if self.peer is not None:
            received = self._exchange(
                blob if taken else b"", send_to=self.peer, recv_from=self._from
            )
            if received:
                try:
                    meta, _body = read_snapshot(received)
                    self._keep(self._file(step, meta["rank"]), received, step, need, free)
                except TornSnapshotError as exc:
                    warnings.warn(
                        f"snapshot of rank {self._from} at step {step}: {exc}", stacklevel=2
                    )
        if not fits.item():
            self._skipped(step, need, free)
        self._prune()
        return taken

    def _free_bytes(self) -> int:
        self._record_job()
        try:
            return self.fs.free_bytes(self.dir)
        except OSError:
            return 1 << 62  # cannot tell: try, and let a full disk say so

    def _record_job(self) -> None:
        if self.fs.kind(self.dir) == "directory":
            return
        self.fs.makedirs(self.dir)
        if self.checkpoint_root is not None:
            record = json.dumps({"checkpoint_root": self.checkpoint_root}).encode()
            self.fs.write_file(self.dir / _JOB_RECORD, record, False)

    def _keep(self, path: Path, blob: bytes, step: int, need: int, free: int) -> bool:
        try:
            _write_whole(self.fs, path, blob)
            return True
        except OSError as exc:
            if not is_out_of_space(exc):
                raise
            self.fs.remove_tree(path.parent, missing_ok=True)  # a part of a step is no use
            self._skipped(step, need, free)
            return False

    def _skipped(self, step: int, need: int, free: int) -> None:
        warnings.warn(
            f"in-memory snapshot of step {step} skipped: it needs {need} bytes in "
            f"{self.dir.parent} on each node and {free} are free on this one; training and "
            "disk checkpoints go on",
            stacklevel=3,
        )

    def _exchange(self, blob: bytes, *, send_to: int, recv_from: int) -> bytes:
        size = torch.tensor([len(blob)], dtype=torch.int64)
        their = torch.zeros(1, dtype=torch.int64)
        for work in (dist.isend(size, send_to), dist.irecv(their, recv_from)):
            work.wait()
        data = torch.tensor(list(blob[:0]), dtype=torch.uint8)
        if blob:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        got = torch.empty(int(their), dtype=torch.uint8)
        for work in (dist.isend(data, send_to), dist.irecv(got, recv_from)):
            work.wait()
        return got.numpy().tobytes()

    def _prune(self) -> None:
        steps = sorted(self._steps_here())
        for step in steps[: -self.keep]:
            self.fs.remove_tree(self.dir / step_name(step), missing_ok=True)

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
            folder = self.dir / step_name(step)
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
