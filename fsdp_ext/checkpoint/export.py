"""A checkpoint's model weights as Hugging Face safetensors: what ``from_pretrained`` loads.

``python -m fsdp_ext.checkpoint export CKPT --to safetensors OUT [--dtype bf16] [--config C]``

- **Only the weights.** The ``Checkpointer`` keeps the model and its optimizer under
  ``model.`` (``model.<fqn>``, ``model.state.<fqn>.exp_avg``...) and extras (LoCo's error
  buffers, a scheduler) under their own names; the export keeps ``model.<fqn>`` and strips
  the prefix, so the names are the HF model's ``state_dict`` names. With ``--config`` the
  model is built on the meta device from it, and exactly its weights are written (a
  missing one is an error naming it).
- **Tied weights** (``tie_word_embeddings``: ``lm_head.weight`` *is*
  ``model.embed_tokens.weight``) are written once, under the name ``save_pretrained`` keeps
  (the first of the tied names in the model's ``state_dict``; the others are the model's
  ``_tied_weights_keys``), which ``from_pretrained`` ties back. Without ``--config`` the
  ties are not known and every name the checkpoint has is written (``from_pretrained``
  loads that too).
- **Checked reads, bounded memory.** Tensors are read through
  :class:`~fsdp_ext.checkpoint.reader.VerifiedFileSystemReader` (sizes and checksums
  checked, no pickle run), one output shard per ``dcp.load``, straight into that shard's
  buffer: memory is about one shard (``max_shard_bytes``) plus the reader's read-ahead
  budget, plus the shard's tensors in their stored dtype when ``--dtype`` converts.
- **HF's layout.** ``model-0000K-of-0000N.safetensors`` (even for N = 1) and
  ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), written last;
  ``config.json`` (and ``generation_config.json`` when beside it) copied from ``--config``.
  Earlier export files in OUT are removed first, so a stale ``model.safetensors`` cannot
  shadow the index. OUT is any location (``/path``, ``file://``, ``s3://``).

CKPT is a checkpoint (a ``step-N`` directory) or a ``Checkpointer`` root, whose newest
intact checkpoint is exported; a local path or ``file://`` URL (S3 once the commit protocol
runs on the blob layer).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_ext.checkpoint.blob import BlobStore
from fsdp_ext.checkpoint.blob_posix import PosixBlobStore
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.manifest import METADATA_NAME
from fsdp_ext.checkpoint.reader import SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint.steps import checkpoint_steps
from fsdp_ext.checkpoint.verify import verify_checkpoint

__all__ = ["DTYPES", "ExportConfig", "ExportReport", "export_safetensors", "parse_size"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX_NAME = "model.safetensors.index.json"
_SHARD = "model-{k:05d}-of-{n:05d}.safetensors"
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
# torch dtype -> safetensors' dtype name
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes, as bytes (HF's units: GB is
    10**9, GiB 2**30)."""
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f"max shard size must be like 5GB, 500MB, 2GiB or bytes, got {text!r}")
    number, unit, suffix = match.groups()
    base = 1024 if suffix and suffix.lower() == "ib" else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


@dataclass(frozen=True)
class ExportConfig:
    """How to export. ``dtype``: "bf16", "fp16", "fp32" or None (as stored; integer tensors
    are never converted). ``config``: a ``config.json`` or a directory holding one, copied
    into OUT and used to pick exactly the model's weights and its ties. ``prefix``: the
    checkpoint's name for the model (the ``Checkpointer``'s is "model."; "" for a plain
    ``dcp.save(model.state_dict())``). ``max_shard_bytes``: the most bytes of tensors per
    file (a bigger tensor gets a file of its own)."""

    dtype: str | None = None
    config: str | None = None
    prefix: str = "model."
    max_shard_bytes: int = 5 * 10**9

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}")
        if self.config is not None and (not isinstance(self.config, str) or not self.config):
            raise ValueError(f"config must be a path to config.json or its directory, got "
                             f"{self.config!r}")  # fmt: skip
        if not isinstance(self.prefix, str):
            raise ValueError(f"prefix must be a str ('model.' for a Checkpointer's), got "
                             f"{self.prefix!r}")  # fmt: skip
        size = self.max_shard_bytes
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"max_shard_bytes must be an int >= 1, got {size!r}")


@dataclass
class ExportReport:
    """What an export wrote: the checkpoint it read, the files, the tensors per file, the
    names left out (tied duplicates; optimizer and other state), the biggest shard buffer."""

    checkpoint: str
    files: dict[str, list[str]] = field(default_factory=dict)
    total_size: int = 0
    tied: dict[str, str] = field(default_factory=dict)  # dropped name -> the name kept
    left_out: list[str] = field(default_factory=list)
    largest_shard_bytes: int = 0


@dataclass(frozen=True)
class _Weight:
    name: str  # in the output (the HF name)
    source: str  # in the checkpoint (with the prefix)
    shape: tuple[int, ...]
    stored: torch.dtype
    dtype: torch.dtype  # in the output

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _checkpoint_path(location: str) -> str:
    """The local directory of the checkpoint to read (the newest intact one of a root)."""
    store = blob_store_for(location)
    if not isinstance(store, PosixBlobStore):
        raise ValueError(
            f"checkpoint {location!r}: only local checkpoints (a path or file://) can be "
            "exported yet; S3 checkpoints follow once the commit protocol runs on the blob "
            "layer. Copy the checkpoint to a local directory and export that"
        )
    if store.head(METADATA_NAME) is not None:
        return store.root
    steps = checkpoint_steps(store.root)
    if not steps:
        raise ValueError(
            f"checkpoint {location!r}: no checkpoint there (no {METADATA_NAME}, and no "
            "step-N checkpoints of a Checkpointer root)"
        )
    for _step, path in reversed(steps):  # the newest that verifies, as a resume picks
        if verify_checkpoint(path).ok:
            return str(path)
    raise ValueError(f"checkpoint {location!r}: no intact checkpoint under this root")


def _read_config(location: str) -> tuple[BlobStore, dict, list[str]]:
    """The store holding ``config.json``, its parsed contents and the files to copy."""
    store = blob_store_for(location)
    key = "config.json"
    if store.head(key) is None:  # a path to the file itself
        if "://" in location:
            parent, _, key = location.rstrip("/").rpartition("/")
        else:
            parent, key = os.path.split(os.path.abspath(location))
        store = blob_store_for(parent)
        if store.head(key) is None:
            raise ValueError(f"config {location!r}: no config.json there (give the file or "
                             "the directory that holds it)")  # fmt: skip
    try:
        parsed = json.loads(store.get(key))
    except ValueError as exc:
        raise ValueError(f"config {location!r}: not JSON ({exc})") from exc
    copies = [key] + (["generation_config.json"] if key == "config.json" else [])
    return store, parsed, [k for k in copies if store.head(k) is not None]


def _model_names(config: dict) -> tuple[list[str], dict[str, str]]:
    """The HF model's ``state_dict`` names for ``config`` (built on the meta device) and its
    ties: {name dropped: name kept}, kept being the first of a tied group."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError("--config needs transformers installed (pip install transformers); "
                         "or export without --config") from exc  # fmt: skip
    hf_config = transformers.AutoConfig.for_model(**config)
    architectures = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if cls is not None:
            model = cls(hf_config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    names = list(model.state_dict(keep_vars=True))
    first_of: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        kept = first_of.setdefault(id(tensor), name)
        if kept != name:
            tied[name] = kept
    return names, tied


def _select(
    metadata, config: ExportConfig, dtype: torch.dtype | None, hf: tuple | None
) -> tuple[list[_Weight], dict[str, str], list[str]]:
    """The weights to write, the tied names dropped, and the checkpoint names left out."""
    tensors = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    prefix = config.prefix
    model = {k[len(prefix) :]: k for k in tensors if k.startswith(prefix)}
    # the flattened optimizer state of the same parts: state.<fqn>.<key>
    optimizer = {n for n in model if n.startswith("state.") and n[6:].rpartition(".")[0] in model}
    names = [n for n in model if n not in optimizer]
    tied: dict[str, str] = {}
    if hf is not None:
        wanted, hf_tied = hf
        chosen = []
        for name in wanted:
            if name in hf_tied:
                tied[name] = hf_tied[name]
                continue
            group = [name, *(t for t, k in hf_tied.items() if k == name)]
            source = next((g for g in group if g in model), None)
            if source is None:
                raise ValueError(
                    f"the checkpoint has no tensor {prefix + name!r} for the model's weight "
                    f"{name!r}: is --config the model that was trained, and is the prefix "
                    f"{prefix!r} right?"
                )
            chosen.append((name, source))
    else:
        chosen = [(n, n) for n in names]
    used = {source for _, source in chosen}
    left_out = sorted(k for k in tensors if not (k.startswith(prefix) and k[len(prefix) :] in used))
    weights = []
    for name, source in chosen:
        meta = tensors[model[source]]
        stored = meta.properties.dtype
        out = dtype if dtype is not None and stored.is_floating_point else stored
        if out not in _ST_DTYPES:
            raise ValueError(f"{model[source]}: dtype {stored} has no safetensors name")
        weights.append(_Weight(name, model[source], tuple(meta.size), stored, out))
    return weights, tied, left_out


def _shards(weights: list[_Weight], max_bytes: int) -> list[list[_Weight]]:
    shards: list[list[_Weight]] = [[]]
    size = 0
    for weight in weights:
        if shards[-1] and size + weight.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(weight)
        size += weight.nbytes
    return [s for s in shards if s]


def _header(weights: Iterable[_Weight]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """safetensors' header (8-byte little-endian length, JSON padded to 8 bytes) and each
    tensor's byte span in the data that follows."""
    spans, offset, entries = {}, 0, {}
    for w in weights:
        spans[w.name] = (offset, offset + w.nbytes)
        entries[w.name] = {"dtype": _ST_DTYPES[w.dtype], "shape": list(w.shape),
                           "data_offsets": [offset, offset + w.nbytes]}  # fmt: skip
        offset += w.nbytes
    text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode(), spans


def _fill_shard(checkpoint: str, shard: list[_Weight]) -> bytearray:
    """One safetensors file's bytes, its tensors read straight into the buffer (through a
    temporary in the stored dtype where the dtype changes or the span is not aligned)."""
    header, spans = _header(shard)
    buffer = bytearray(len(header) + sum(w.nbytes for w in shard))
    buffer[: len(header)] = header
    state: dict[str, torch.Tensor] = {}
    converted: list[tuple[_Weight, torch.Tensor, torch.Tensor]] = []
    for w in shard:
        start, end = spans[w.name]
        target = torch.frombuffer(buffer, dtype=torch.uint8, count=end - start,
                                  offset=len(header) + start) if end > start else None  # fmt: skip
        aligned = (len(header) + start) % w.dtype.itemsize == 0
        if target is not None and w.stored == w.dtype and aligned:
            state[w.source] = target.view(w.dtype).view(w.shape)
        else:
            temporary = torch.empty(w.shape, dtype=w.stored)
            state[w.source] = temporary
            if target is not None:
                converted.append((w, temporary, target))
    if state:
        try:
            dcp.load(
                state,
                storage_reader=VerifiedFileSystemReader(checkpoint),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
        except CheckpointException as exc:  # a BaseException: unwrap what the read raised
            causes = [cause for cause, _tb in exc.failures.values()]
            found = next((c for c in causes if isinstance(c, Exception)), None)
            if found is None:
                raise
            raise found from None
    for w, temporary, target in converted:
        target.copy_(temporary.to(w.dtype).contiguous().view(-1).view(torch.uint8))
    return buffer


def export_safetensors(
    checkpoint: str, out: str, config: ExportConfig | None = None
) -> ExportReport:
    """Write ``checkpoint``'s model weights to ``out`` as HF safetensors (module docstring)."""
    config = config or ExportConfig()
    path = _checkpoint_path(checkpoint)
    metadata = VerifiedFileSystemReader(path).read_metadata()
    hf = None
    copies: list[tuple[BlobStore, str]] = []
    if config.config is not None:
        config_store, parsed, names = _read_config(config.config)
        hf = _model_names(parsed)
        copies = [(config_store, name) for name in names]
    dtype = DTYPES[config.dtype] if config.dtype else None
    weights, tied, left_out = _select(metadata, config, dtype, hf)
    if not weights:
        raise ValueError(
            f"checkpoint {checkpoint!r}: no model weights under the prefix {config.prefix!r} "
            f"(it holds {sorted(metadata.state_dict_metadata)[:5]}...); pass the prefix its "
            "model was saved under"
        )
    target = blob_store_for(out)
    for key in target.list(""):
        if "/" not in key and _OURS.fullmatch(key):
            target.delete(key)  # a stale model.safetensors would shadow the index
    shards = _shards(weights, config.max_shard_bytes)
    report = ExportReport(checkpoint=path, tied=tied, left_out=left_out)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        name = _SHARD.format(k=k, n=len(shards))
        data = _fill_shard(path, shard)
        report.largest_shard_bytes = max(report.largest_shard_bytes, len(data))
        target.put(name, data)
        del data
        report.files[name] = [w.name for w in shard]
        weight_map.update({w.name: name for w in shard})
        report.total_size += sum(w.nbytes for w in shard)
    for store, name in copies:
        target.put(name, store.get(name))
    index = {"metadata": {"total_size": report.total_size}, "weight_map": weight_map}
    target.put(INDEX_NAME, json.dumps(index, indent=2).encode())  # last: the export is whole
    return report
