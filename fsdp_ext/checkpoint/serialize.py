"""One checkpoint file's items, written straight from the tensors' own memory.

Stock DCP's write loop (``filesystem._write_files_from_queue``) ``torch.save``s each tensor,
which computes the zip record's CRC-32 over every byte, then clones any tensor that is a view
of a larger storage (``torch.save`` would write the whole storage). Both cost a background
write what the training step needs: CPU time on a host whose cores train, and memory. Here
each tensor's archive is written without the zip CRC (the manifest's CRC-32, computed as
the bytes stream out, covers them; ``torch.load`` never checks the zip's), and a contiguous
view gets a tensor of its own over the same bytes instead of a copy. The files are the
stock format: ``FileSystemReader`` and ``torch.load`` read them.

An archive is the tensor's bytes between records that depend on its layout alone (dtype,
shape, strides: the pickle, the zip headers, the padding that aligns the bytes), so those
records are made once per layout and kept (:class:`ArchiveLayouts`): the saves after the
first write each tensor as three writes. ``torch.save``'s Python work per tensor (a pickler
class built, six records, a pickle) was half the CPU time of a background write, about
0.25 s per save of the 6-block MoE's 490 tensors per rank, and that time came out of the
training step on a host whose cores train.

A streamed put (an S3 multipart upload) takes an item as chunks (:func:`item_chunks`): the
archive's small records copied, and the tensor's bytes as a view of its own memory, so that
the upload copies them slice by slice into the part it sends and no second copy of the
tensor is ever made.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections import OrderedDict
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from fsdp_ext._torch import DcpStorageInfo, storage_alignment, write_tensor_archive

__all__ = [
    "ArchiveLayouts",
    "SavedValues",
    "item_chunks",
    "own_storage",
    "saved_value",
    "write_items",
]


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU with a storage of exactly its bytes, so that its archive holds
    those bytes alone. A contiguous view of a larger storage is aliased, not copied; only a
    non-contiguous (or empty) one is copied."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    storage = tensor.untyped_storage()
    if storage.nbytes() == tensor.nbytes and tensor.storage_offset() == 0:
        return tensor
    if not tensor.is_contiguous() or tensor.nbytes == 0:
        return tensor.clone(memory_format=torch.contiguous_format)
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    alias = torch.frombuffer(memoryview(raw), dtype=torch.uint8)
    return alias.view(tensor.dtype).view(tensor.shape)


class _Kept:
    """At most ``size`` entries, the least recently used dropped first; a writer's threads
    share it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any) -> Any:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)


class ArchiveLayouts:
    """The records of a ``torch.save`` archive before and after its tensor's bytes, by the
    tensor's layout, made once by :func:`write_tensor_archive` and then reused (only where it
    writes no CRC: a CRC record would depend on the bytes).

    Only a plain CPU tensor whose storage is exactly its bytes has one (what
    :func:`own_storage` gives): anything that ``torch.save`` pickles more of (a subclass,
    ``requires_grad``, names, attributes, the conjugate or negative bit, a quantized or
    sparse tensor) is written by :func:`write_tensor_archive` every time. At most ``size``
    layouts are kept, the least recently used dropped first."""

    def __init__(self, size: int = 8192) -> None:
        self._records = _Kept(size)  # layout -> (bytes before, bytes after)

    def records(self, tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
        """The archive's bytes before and after the tensor's bytes; None where the tensor
        is not plain (or torch wrote its bytes from a copy of its own)."""
        key = _layout(tensor)
        if key is None:
            return None
        records = self._records.get(key)
        if records is not None:
            return records
        sink = _ChunkSink(tensor)
        crc_free = write_tensor_archive(tensor, sink)  # else the records hold the data's CRC
        chunks = sink.finish()
        if not crc_free or len(chunks) != 3 or sink.data_index != 1:
            return None
        records = (bytes(chunks[0]), bytes(chunks[2]))
        self._records.put(key, records)
        return records


def _layout(tensor: torch.Tensor) -> tuple | None:
    """What a plain tensor's archive records depend on; None for any other tensor."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or any(getattr(tensor, "names", ()))  # named tensors (gone in newer releases)
        or tensor.__dict__
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.nbytes
        or tensor.nbytes == 0
    ):
        return None
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), storage_alignment())


_LAYOUTS = ArchiveLayouts()

_PLAIN = (int, float, bool, str, bytes, type(None))


def _is_plain(value: Any) -> bool:
    """A value of builtins alone (no tensor, no class of the user's): its ``torch.save``
    archive is a function of its pickle."""
    if isinstance(value, _PLAIN):
        return type(value) in _PLAIN
    if type(value) in (tuple, list):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


class SavedValues:
    """``torch.save``'s archive of each plain value (an optimizer's ``lr``, ``betas``, ...),
    made once per value and reused: a flattened optimizer state holds one such entry per
    parameter and setting (308 of them per rank on the 6-block MoE), and ``torch.save``
    costs each 0.2 ms of Python on every save. Keyed by the value's pickle, which is the
    archive's one record that depends on the value. At most ``size`` kept, least recently
    used dropped first."""

    def __init__(self, size: int = 8192) -> None:
        self._archives = _Kept(size)  # pickle -> archive

    def archive(self, value: Any) -> bytes:
        if not _is_plain(value):
            return _torch_save(value)
        key = pickle.dumps(value, protocol=2)
        found = self._archives.get(key)
        if found is None:
            found = _torch_save(value)
            self._archives.put(key, found)
        return found


def _torch_save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


_VALUES = SavedValues()


def saved_value(value: Any) -> io.BytesIO:
    """``torch.save(value)``'s bytes, as stock DCP's planner gives a non-tensor item."""
    return io.BytesIO(_VALUES.archive(value))


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage, in storage order (what its archive holds; for a
    transposed tensor not its elements' order), as a view of that memory."""
    flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())


def write_items(
    stream: BinaryIO, file_name: str, items: list[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    """Write ``items`` into ``stream`` (pickled bytes first, then tensors, in plan order, as
    the stock loop does); the results ``.metadata`` records (file name, offset, length)."""
    results = []
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    gap_before = getattr(stream, "gap_before", None)
    for item in ordered:
        offset = stream.tell()
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        else:
            tensor = own_storage(data)
            records = _LAYOUTS.records(tensor)
            if records is None:
                write_tensor_archive(tensor, stream)
            else:
                payload = _tensor_bytes(tensor)
                gap = 0 if gap_before is None else gap_before(payload, len(records[0]))
                if gap:  # zeros between two items, in neither: the bytes then go uncopied
                    stream.write(bytes(gap))
                    offset += gap
                stream.write(records[0])
                stream.write(payload)
                stream.write(records[1])
                stream.flush()
        length = stream.tell() - offset
        info = DcpStorageInfo(relative_path=file_name, offset=offset, length=length)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    return results


class _ChunkSink:
    """What ``write_tensor_archive`` writes, as chunks: the write of the tensor's storage
    (torch hands it over as a view of that memory) becomes a view that keeps the tensor
    alive; the small records around it are copied, coalesced."""

    def __init__(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.tensor, self._start, self._nbytes = tensor, storage.data_ptr(), storage.nbytes()
        self.chunks: list[memoryview] = []
        self.data_index: int | None = None  # which chunk is the tensor's own memory
        self._small = bytearray()
        self._position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._nbytes and len(view) == self._nbytes and _address(view) == self._start:
            self._flush()
            self.data_index = len(self.chunks)
            self.chunks.append(_tensor_bytes(self.tensor))
        else:
            self._small += view
        self._position += len(view)
        return len(view)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def _flush(self) -> None:
        if self._small:
            self.chunks.append(memoryview(self._small))
            self._small = bytearray()

    def finish(self) -> list[memoryview]:
        self._flush()
        return self.chunks


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def item_chunks(
    item: WriteItem, planner: SavePlanner, file_name: str, offset: int
) -> tuple[list[memoryview], WriteResult]:
    """One item in the stock format as chunks for a streamed put, with its result
    (``offset``: where it starts in its file). A tensor's bytes are a view of its own memory
    (a second copy only of a non-contiguous one); where torch writes them from a buffer of its
    own instead, they are copied, which costs memory, never correctness."""
    data: Any = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        chunks = [data.getbuffer()]
    else:
        tensor = own_storage(data)
        records = _LAYOUTS.records(tensor)
        if records is None:
            sink = _ChunkSink(tensor)
            write_tensor_archive(tensor, sink)
            chunks = sink.finish()
        else:
            chunks = [memoryview(records[0]), _tensor_bytes(tensor), memoryview(records[1])]
    length = sum(len(c) for c in chunks)
    info = DcpStorageInfo(relative_path=file_name, offset=offset, length=length)
    return chunks, WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
