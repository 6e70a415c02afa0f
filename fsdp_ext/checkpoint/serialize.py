"""One checkpoint file's items, written straight from the tensors' own memory.

Stock DCP's write loop (``filesystem._write_files_from_queue``) ``torch.save``s each tensor,
which computes the zip record's CRC-32 over every byte, then clones any tensor that is a view
of a larger storage (``torch.save`` would write the whole storage). Both cost a background
write what the training step needs: CPU time on a host whose cores train, and memory. Here
each tensor's archive is written without the zip CRC (the manifest's CRC-32, computed as
the bytes stream out, covers them; ``torch.load`` never checks the zip's), and a contiguous
view gets a tensor of its own over the same bytes instead of a copy. The files are the
stock format: ``FileSystemReader`` and ``torch.load`` read them.

A streamed put (an S3 multipart upload) takes an item as chunks (:func:`item_chunks`): the
archive's small records copied, and the tensor's bytes as a view of its own memory, so that
the upload copies them slice by slice into the part it sends and no second copy of the
tensor is ever made.
"""

from __future__ import annotations

from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from fsdp_ext._torch import DcpStorageInfo, write_tensor_archive

__all__ = ["item_chunks", "own_storage", "write_items"]


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


def write_items(
    stream: BinaryIO, file_name: str, items: list[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    """Write ``items`` into ``stream`` (pickled bytes first, then tensors, in plan order, as
    the stock loop does); the results ``.metadata`` records (file name, offset, length)."""
    results = []
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
    ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
    for item in ordered:
        offset = stream.tell()
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        else:
            write_tensor_archive(own_storage(data), stream)
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
        self._small = bytearray()
        self._position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._nbytes and len(view) == self._nbytes and _address(view) == self._start:
            self._flush()
            self.chunks.append(memoryview(self.tensor.reshape(-1).view(torch.uint8).numpy()))
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
        sink = _ChunkSink(own_storage(data))
        write_tensor_archive(sink.tensor, sink)
        chunks = sink.finish()
    length = sum(len(c) for c in chunks)
    info = DcpStorageInfo(relative_path=file_name, offset=offset, length=length)
    return chunks, WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
