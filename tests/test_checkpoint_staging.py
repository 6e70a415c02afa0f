"""What a background save costs besides its bytes: the staging buffers (plain tensors,
reused) and the writer's tensor records (no copy of a view, no zip
CRC), and that the background write flushes every file before it publishes. Unit-level,
one process, under a second in all."""

import io
import os
import pickle
import threading
import traceback
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from fsdp_ext import Checkpointer, SpreadFileSystemWriter, SpreadSavePlanner
from fsdp_ext.checkpoint import LocalStorage, verify_checkpoint
from fsdp_ext.checkpoint.serialize import own_storage
from fsdp_ext.job.staging import StagingBuffers


def _state():
    return {
        "w": torch.randn(8, 16),
        "opt": {"step": torch.tensor(3.0), "exp_avg": [torch.randn(5), torch.randn(2, 2)]},
        "bf16": torch.randn(3, 7).bfloat16(),
        "empty": torch.empty(0, 4),
        "lr": 0.1,
    }


def test_staging_buffers_are_plain_tensors_reused_while_shapes_hold():
    staging, state = StagingBuffers(), _state()
    staged = staging.stage(state)
    first = staged["w"].data_ptr()
    tensors = [staged["w"], staged["opt"]["step"], *staged["opt"]["exp_avg"], staged["bf16"]]
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.nbytes  # a storage of its own bytes
    assert staging.nbytes == sum(t.nbytes for t in tensors)
    assert torch.equal(staged["bf16"], state["bf16"]) and staged["lr"] == 0.1
    assert torch.equal(staged["opt"]["exp_avg"][1], state["opt"]["exp_avg"][1])
    state["w"].add_(1.0)  # training changes the source: the staged copy does not move
    assert not torch.equal(staged["w"], state["w"])
    again = staging.stage(state)
    assert again["w"].data_ptr() == first and torch.equal(again["w"], state["w"])
    state["w"] = torch.randn(4, 4)  # a new shape: a new buffer, the right bytes
    third = staging.stage(state)
    assert third["w"].shape == (4, 4) and torch.equal(third["w"], state["w"])


def test_a_view_is_written_as_its_own_bytes_without_a_copy_or_the_zip_crc(tmp_path):
    base = torch.arange(1000, dtype=torch.float32)
    view = base[100:300].view(10, 20)
    alias = own_storage(view)
    assert alias.data_ptr() == view.data_ptr() and alias.untyped_storage().nbytes() == 800
    state = {"layers.0.view": view, "layers.0.t": torch.randn(6, 4).t()}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=SpreadFileSystemWriter(path), planner=SpreadSavePlanner())
    assert verify_checkpoint(path).ok
    (data,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    assert data.stat().st_size < 800 + 2 * 4 * 24 + 8192  # not the 4000-byte storage
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=FileSystemReader(path))  # the stock reader
    assert all(torch.equal(out[k], v) for k, v in state.items())
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)  # written just now by this test
    info = meta.storage_data[next(i for i in meta.storage_data if i.fqn == "layers.0.view")]
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        archive = f.read(info.length)
    crcs = [i.CRC for i in zipfile.ZipFile(io.BytesIO(archive)).infolist()]
    assert crcs and set(crcs) == {0}  # the manifest's CRC-32 covers these bytes instead


class _Recording(LocalStorage):
    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def before(self, op, path):
        if threading.current_thread().name.startswith("fsdp_ext-save"):
            self.events.append((op, os.path.basename(str(path))))


def test_a_background_write_fsyncs_every_file_before_it_publishes(tmp_path):
    fs = _Recording()
    model = nn.Linear(16, 8)
    ckpt = Checkpointer(tmp_path / "out", model=model, keep=None, fs=fs)
    ckpt.save(1, blocking=False)
    ckpt.close()
    ops = fs.events
    publish_ops = ("rename", "exchange", "symlink")
    published = next(
        i for i, (op, n) in enumerate(ops) if n == "step-0000001" and op in publish_ops
    )
    written = {n for op, n in ops[:published] if op == "write" and n.endswith(".distcp")}
    synced = {n for op, n in ops[:published] if op == "fsync"}
    assert written and written | {".metadata"} <= synced, (written, synced)


class _Priority(LocalStorage):
    def __init__(self):
        super().__init__()
        self.nice: set[int] = set()

    def before(self, op, path):
        if threading.current_thread().name.startswith("fsdp_ext-save"):
            self.nice.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))


def test_the_background_write_runs_at_a_lower_priority_than_training(tmp_path):
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    fs = _Priority()
    ckpt = Checkpointer(tmp_path / "out", model=nn.Linear(4, 4), keep=None, fs=fs)
    ckpt.save(1, blocking=False)
    ckpt.close()
    assert fs.nice == {min(19, own + 19)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # untouched


def test_an_async_save_checks_the_fence_in_its_write_and_says_where_its_time_went(tmp_path):
    """``save(blocking=False)`` runs no collective and reads no ownership record: a takeover
    is found by its background write, which publishes nothing and raises at ``close``."""
    from fsdp_ext.checkpoint import LocalStorage, checkpoint_steps
    from fsdp_ext.checkpoint.fence import OWNER_DIR, DirectoryFencedError, record_name
    from fsdp_ext.checkpoint.lock import LockOwner

    root = tmp_path / "out"
    model = nn.Linear(8, 4)
    ckpt = Checkpointer(root, model=model, keep=None)
    ckpt.save(1, blocking=False)
    ckpt.wait()
    ckpt.save(2)
    assert set(ckpt.stats.phases_s[0]) == {"wait", "state_dict", "stage", "start"}
    assert set(ckpt.stats.phases_s[1]) == {"wait", "fence", "write"}
    for blocked, phases in zip(ckpt.stats.blocked_s, ckpt.stats.phases_s, strict=True):
        assert abs(sum(phases.values()) - blocked) < 1e-9
    other = LockOwner.here("owner-other", lease_s=60.0, generation=2)  # another job took over
    LocalStorage().symlink(other.encode(), root / OWNER_DIR / record_name(2))
    ckpt.save(3, blocking=False)  # returns: the check runs in the write
    try:
        ckpt.close()
    except DirectoryFencedError as exc:
        assert "taken over" in str(exc)
    else:
        raise AssertionError("close() did not raise the fenced write's error")
    assert [s for s, _ in checkpoint_steps(root)] == [1, 2]  # nothing of step 3 landed


def test_archive_records_made_once_per_layout_give_torch_saves_bytes_for_any_data():
    """The records kept for a layout, around another tensor's bytes, are that tensor's own
    archive (written afresh for comparison); a different layout of the same byte count
    gets records of its own, and a tensor torch pickles more of gets none."""
    from fsdp_ext._torch import write_tensor_archive
    from fsdp_ext.checkpoint.serialize import ArchiveLayouts

    def fresh(tensor):
        buffer = io.BytesIO()
        write_tensor_archive(tensor, buffer)
        return buffer.getvalue()

    layouts = ArchiveLayouts()
    tensors = [torch.randn(8, 16), torch.tensor(3.0), torch.randn(7).bfloat16(), torch.arange(5)]
    tensors += [torch.ones(2, 3, dtype=torch.bool), torch.randn(4, 6).t().contiguous()]
    for first in tensors:
        layouts.records(first)  # made from this tensor
        second = torch.randint_like(first, 0, 100) if first.dtype != torch.bool else ~first
        before, after = layouts.records(second)  # reused for another tensor's bytes
        archive = before + second.reshape(-1).view(torch.uint8).numpy().tobytes() + after
        assert archive == fresh(second)
        loaded = torch.load(io.BytesIO(archive), weights_only=True)
        assert loaded.shape == second.shape and loaded.stride() == second.stride()
        assert torch.equal(loaded, second)
    square, wide = torch.randn(4, 4), torch.randn(2, 8)  # the same bytes, another layout
    before, after = layouts.records(square)
    wide_before, wide_after = layouts.records(wide)
    loaded = torch.load(io.BytesIO(wide_before + wide.numpy().tobytes() + wide_after))
    assert (before, after) != (wide_before, wide_after)
    assert loaded.shape == (2, 8) and torch.equal(loaded, wide)
    assert layouts.records(nn.Parameter(torch.randn(4, 4))) is None  # a subclass
    assert layouts.records(torch.randn(4, 4, requires_grad=True)) is None
    assert layouts.records(torch.randn(10)[2:6]) is None  # a view of a larger storage


def test_plain_values_archives_are_torch_saves_and_keep_their_types():
    """``saved_value`` is ``torch.save``'s archive for every value; values whose reprs
    match but types differ (1, 1.0, True) are kept apart, and a non-plain value (a tensor)
    is saved afresh each time."""
    from fsdp_ext.checkpoint.serialize import saved_value

    values = [1, 1.0, True, 0.0, -0.0, None, "lr", (0.9, 0.95), [1, (2.0,)], {"a": 1e-3}]
    for value in values + values:  # the second round from what the first kept
        buffer = io.BytesIO()
        torch.save(value, buffer)
        archive = saved_value(value).getvalue()
        assert archive == buffer.getvalue()
        loaded = torch.load(io.BytesIO(archive), weights_only=True)
        assert type(loaded) is type(value) and loaded == value
    for tensor in (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])):
        loaded = torch.load(saved_value(tensor), weights_only=True)
        assert torch.equal(loaded, tensor)


def test_no_garbage_collection_runs_in_the_background_write(tmp_path):
    """A collection of the oldest generation takes 150-200 ms on a training process (the
    interpreter's whole heap) and holds the GIL: in the write's thread, at nice 19, it
    stopped the step for that long. Automatic collection is off from ``save`` to the end of
    the write and back on after; a caller's own ``gc.disable()`` is left as it was."""
    import gc

    collected_in: list[str] = []

    def record(phase, info):
        # in the write: under the checkpoint code (not the thread's own teardown, after it)
        if phase == "start" and any("fsdp_ext" in f.filename for f in traceback.extract_stack()):
            collected_in.append(threading.current_thread().name)

    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)])  # plans of many items
    ckpt = Checkpointer(tmp_path / "out", model=model, keep=None)
    gc.callbacks.append(record)
    threshold = gc.get_threshold()
    gc.set_threshold(10, 1, 1)  # a collection every few allocations, were any allowed
    try:
        assert gc.isenabled()
        ckpt.save(1, blocking=False)
        ckpt.wait()
        assert gc.isenabled()  # back on
        gc.disable()  # the caller's choice (torchtitan's gc_freq does this)
        ckpt.save(2, blocking=False)
        ckpt.close()
        assert not gc.isenabled()  # kept
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(record)
    assert not [name for name in collected_in if name.startswith("fsdp_ext-save")]
    assert verify_checkpoint(tmp_path / "out" / "step-0000002").ok


def test_the_gil_comes_back_to_the_step_sooner_while_a_background_write_runs(tmp_path):
    """From ``save`` to the end of its write the interpreter's switch interval is 0.5 ms, so
    a step that gave up the GIL in a torch op gets it back from the write's thread sooner;
    after the write it is the caller's again, whatever the caller had set, and a save that
    fails before its write starts leaves it as it was too."""
    import sys

    from fsdp_ext.job.checkpointer import BACKGROUND_SWITCH_INTERVAL_S

    seen: list[float] = []
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    ckpt = Checkpointer(tmp_path / "out", model=model, keep=None)
    own = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.002)  # the caller's choice
        original = ckpt._write

        def write(*args, **kwargs):  # the interval inside the write's own thread
            seen.append(sys.getswitchinterval())
            return original(*args, **kwargs)

        ckpt._write = write
        ckpt.save(1, blocking=False)
        ckpt.wait()
        assert seen == [BACKGROUND_SWITCH_INTERVAL_S] and BACKGROUND_SWITCH_INTERVAL_S == 0.0005
        assert sys.getswitchinterval() == pytest.approx(0.002)  # the caller's, back
        ckpt._staging.stage = None  # the next save fails while staging, before any write
        with pytest.raises(TypeError):
            ckpt.save(2, blocking=False)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(own)
        ckpt.close()


def test_a_transposed_tensor_is_written_in_its_storage_order_by_both_write_paths():
    """A tensor whose storage is exactly its bytes but not in its elements' order (a
    transpose) is written as its archive says: the storage's bytes. The streamed put's
    chunks once held the elements' order instead, and loaded a scrambled tensor."""
    from fsdp_ext.checkpoint.serialize import item_chunks, write_items

    state = {"t": torch.randn(6, 4).t(), "p": torch.randn(3, 2, 4).permute(2, 0, 1)}
    state["c"] = torch.randn(4, 6)  # contiguous, the same layout as "t" once copied
    planner = SpreadSavePlanner()
    planner.set_up_planner(state, None, True)
    items = planner.create_local_plan().items
    stream = io.BytesIO()
    results = write_items(stream, "f", items, planner)
    for item, result in zip(items, results, strict=True):
        info = result.storage_data
        archive = stream.getvalue()[info.offset : info.offset + info.length]
        chunks, _ = item_chunks(item, planner, "f", 0)
        expected = state[item.index.fqn]
        for data in (archive, b"".join(bytes(c) for c in chunks)):
            assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), expected)


def test_a_ranks_files_are_sized_by_its_shards_bytes_not_the_whole_tensors():
    """A sharded tensor's write item names the whole tensor's size and this rank's chunk:
    the files (and the disk-space and S3 stream sizing) count the chunk, the bytes this rank
    writes. Counted whole, each layer of a 2-way shard looked twice its size, and a run of
    layers that fills a file got cut in half."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItemType
    from torch.distributed.checkpoint.planner import WriteItem as Item

    from fsdp_ext.checkpoint.file_groups import group_items
    from fsdp_ext.checkpoint.layers import default_layer_key
    from fsdp_ext.checkpoint.planner import item_nbytes

    def shard(layer: int) -> Item:  # rows 0-3 of an 8 x 8 fp32 tensor: 128 of its 256 bytes
        chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 8]))
        data = TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size([8, 8]))
        fqn = f"layers.{layer}.w"
        return Item(MetadataIndex(fqn, torch.Size([0, 0])), WriteItemType.SHARD, tensor_data=data)

    items = [shard(i) for i in range(4)]
    assert item_nbytes(items[0]) == 128
    files = group_items(SavePlan(items), default_layer_key, min_file_bytes=256, thread_count=1)
    assert [name for name, _ in files] == ["layers.0..layers.1", "layers.2..layers.3"]


def test_the_deferred_copy_runs_at_the_writes_lower_priority(tmp_path):
    """The copy of the optimizer's tensors (``overlap_staging``) runs at nice 19 like the
    write: paired runs of checkpoint_stall put the step slowdown at 1.12-1.21 against
    1.20-1.24 at the training's priority, and the step never waited for the copy."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ckpt = Checkpointer(
        tmp_path / "out", model=model, optimizer=opt, keep=None, overlap_staging=True
    )
    seen: list[int] = []
    copy = ckpt._staging.copy_deferred

    def copy_and_record():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        copy()

    ckpt._staging.copy_deferred = copy_and_record
    ckpt.save(1, blocking=False)
    opt.step()  # waits for the copy
    ckpt.close()
    assert seen == [min(19, own + 19)]
    assert verify_checkpoint(tmp_path / "out" / "step-0000001").ok


def test_the_kept_archives_are_bounded_and_stay_right_after_an_eviction():
    from fsdp_ext.checkpoint.serialize import ArchiveLayouts, SavedValues

    layouts, values = ArchiveLayouts(size=2), SavedValues(size=2)
    tensors = [torch.randn(2, 3), torch.randn(3, 2), torch.randn(6)]  # three layouts
    for tensor in tensors + tensors:  # the first is dropped, then made again
        before, after = layouts.records(tensor)
        data = before + tensor.numpy().tobytes() + after
        assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), tensor)
    for value in [0.1, 0.2, 0.3, 0.1]:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        assert values.archive(value) == buffer.getvalue()
    assert len(layouts._records) == 2 and len(values._archives) == 2
