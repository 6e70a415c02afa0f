"""One clear error for each way a user can get a save or a load wrong, and never a traceback
from ``verify_checkpoint``. Single-process saves (``dcp`` without a process group)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdp_ext.checkpoint import (
    CheckpointIntegrityError,
    CheckpointSpaceError,
    LocalStorage,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
    remove_checkpoint,
    verify_checkpoint,
)
from fsdp_ext.checkpoint.__main__ import main as cli
from fsdp_ext.checkpoint.manifest import SELF_CHECKSUM, seal
from tests.dcp_errors import error_text, logged_metadata_errors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int = 0, rows: int = 64) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(rows, 32, generator=gen),
        "embed": torch.randn(rows, 32, generator=gen),
        "step": seed,
    }


def save(path: Path, sd: dict | None = None, **writer_kwargs) -> Path:
    dcp.save(
        sd or state(),
        storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0, **writer_kwargs),
        planner=SpreadSavePlanner(),
    )
    return path


def cause(excinfo) -> BaseException:
    (err, _trace), *_ = excinfo.value.failures.values()
    return err


def version(path: Path) -> Path:
    return path.parent / os.readlink(path) if path.is_symlink() else path


def load(path: Path, **reader_kwargs) -> dict:
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in state().items()}
    dcp.load(
        got,
        storage_reader=VerifiedFileSystemReader(path, **reader_kwargs),
        planner=SafeLoadPlanner(),
    )
    return got


def rewrite_metadata(path: Path, metadata_bytes: bytes) -> Path:
    """Replace .metadata and make the manifest agree, as someone who can write both could."""
    root = version(path)
    (root / ".metadata").write_bytes(metadata_bytes)
    manifest = json.loads((root / ".manifest.json").read_text())
    manifest["metadata"].update(
        size=len(metadata_bytes), checksum=f"{zlib.crc32(metadata_bytes):08x}"
    )
    (root / ".manifest.json").write_text(seal(manifest, SELF_CHECKSUM))
    return root / ".metadata"


# -- verify never raises ---------------------------------------------------------------------


def test_a_non_utf8_manifest_is_reported_not_raised(tmp_path, capsys):
    path = save(tmp_path / "ckpt")
    manifest = version(path) / ".manifest.json"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] = 0xFF
    manifest.write_bytes(bytes(data))
    report = verify_checkpoint(path)
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith(f"{manifest}: not a readable manifest")
    assert cli(["verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and str(manifest) in out.out
    with logged_metadata_errors() as logged, pytest.raises(CheckpointException) as err:
        load(path)
    assert f"{manifest}: not a readable manifest" in error_text(err.value, logged)


def _storage_info_class() -> type:
    """The class DCP stores per item, taken from a real checkpoint (no private import)."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(tmp))
        meta = dcp.FileSystemReader(tmp).read_metadata()
    return type(next(iter(meta.storage_data.values())))


def _metadata_variants() -> dict:
    """Metadata that unpickles without a forbidden global but is not what DCP writes."""
    storage_info = _storage_info_class()
    tensor = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([4]),
        [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
    )
    index = MetadataIndex("w", torch.Size([0]))
    return {
        "dict": {"state_dict_metadata": {}},
        "entry_dict": Metadata(state_dict_metadata={"w": {"size": [4], "chunks": []}}),
        "storage_meta_dict": Metadata(state_dict_metadata={}, storage_meta={"modules": []}),
        "storage_data_dict": Metadata(
            state_dict_metadata={"w": tensor}, storage_data={index: {"relative_path": "x"}}
        ),
        "path_out_of_the_checkpoint": Metadata(
            state_dict_metadata={"w": tensor},
            storage_data={index: storage_info("../../elsewhere.distcp", 0, 16)},
        ),
        "no_fields": Metadata.__new__(Metadata),
    }


VARIANTS = _metadata_variants()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_that_is_not_dcp_metadata_is_unsafe(tmp_path, variant):
    """Reader: UnsafeCheckpointError naming the file (not an AttributeError from deep in
    DCP); verify: one problem line naming it."""
    path = save(tmp_path / "ckpt")
    meta = rewrite_metadata(path, pickle.dumps(VARIANTS[variant]))
    with pytest.raises(UnsafeCheckpointError) as err:
        VerifiedFileSystemReader(path).read_metadata()
    assert str(err.value).startswith(f"{meta}: ") and "\n" not in str(err.value)
    report = verify_checkpoint(path)
    assert [p for p in report.problems if p.startswith(f"{meta}: ")], report.problems
    if variant == "dict":  # the type is named, not a missing attribute
        assert str(err.value) == (
            f"{meta}: holds a dict, not DCP Metadata; DCP never writes that, refusing it"
        )


def test_chunks_that_do_not_cover_a_tensor_are_reported(tmp_path):
    """Metadata whose one chunk of ``embed`` covers its first half only (manifest made to
    match): the stock reader loads it without a word and leaves the second half as it was;
    verify names the tensor and what the chunks cover."""
    path = save(tmp_path / "ckpt")
    root = version(path)
    meta = dcp.FileSystemReader(path).read_metadata()
    embed = meta.state_dict_metadata["embed"]
    rows, cols = embed.size
    embed.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([rows // 2, cols]))]
    meta.storage_meta.load_id = None
    rewrite_metadata(path, pickle.dumps(meta))
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in state().items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(got["embed"][: rows // 2], state()["embed"][: rows // 2])
    assert not got["embed"][rows // 2 :].any()  # silently untouched
    report = verify_checkpoint(path)
    assert report.problems == [
        f"{root}: tensor embed chunks cover {rows // 2 * cols} of {rows * cols} elements"
    ]


# -- saves that cannot succeed ---------------------------------------------------------------


def test_layer_key_returning_a_non_str_names_layer_key(tmp_path):
    for planner, writer in (
        (SpreadSavePlanner(layer_key=lambda fqn: 3), {}),
        (SpreadSavePlanner(), {"layer_key": lambda fqn: 3}),
    ):
        with pytest.raises(CheckpointException) as err:
            dcp.save(
                state(),
                storage_writer=SpreadFileSystemWriter(tmp_path / "ckpt", **writer),
                planner=planner,
            )
        error = cause(err)
        assert isinstance(error, TypeError)
        assert "layer_key must return a str layer id or None; it returned 3 (int)" in str(error)
    assert sorted(os.listdir(tmp_path)) == []  # nothing written, the lock released


class FullDisk(LocalStorage):
    """Streams fail with ENOSPC once ``room`` bytes have gone to data files."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room

    def create_stream(self, path, mode):
        stream_cm = super().create_stream(path, mode)
        if "w" not in mode or not str(path).endswith(".distcp"):
            return stream_cm
        disk = self

        class Full:
            def __enter__(self):
                self.stream = stream_cm.__enter__()
                real_write = self.stream._raw.write

                def write(data):
                    n = memoryview(data).nbytes
                    if n > disk.room:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                    disk.room -= n
                    return real_write(data)

                self.stream._raw.write = write
                return self.stream

            def __exit__(self, *exc):
                return stream_cm.__exit__(*exc)

        return Full()


def test_disk_full_says_space_and_keeps_the_old_checkpoint(tmp_path):
    path = save(tmp_path / "ckpt", state(seed=0))
    with pytest.raises(CheckpointException) as err:
        save(path, state(seed=1, rows=4096), fs=FullDisk(room=100_000))
    error = cause(err)
    assert isinstance(error, CheckpointSpaceError) and error.errno == errno.ENOSPC
    assert "no space left on the device" in str(error)
    assert "needs room for both" in str(error) and "bytes are free" in str(error)
    assert torch.equal(load(path)["embed"], state(seed=0)["embed"])
    assert verify_checkpoint(path).ok


_TMPFS_SAVE = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from fsdp_ext.checkpoint import SpreadFileSystemWriter, SpreadSavePlanner, verify_checkpoint
    path = sys.argv[1] + "/ckpt"
    small = {"w": torch.ones(16_000)}
    dcp.save(small, storage_writer=SpreadFileSystemWriter(path), planner=SpreadSavePlanner())
    try:
        big = {"w": torch.ones(200_000)}
        dcp.save(big, storage_writer=SpreadFileSystemWriter(path), planner=SpreadSavePlanner())
        print(json.dumps({"error": None}))
    except BaseException as exc:
        (cause, _), *_ = exc.failures.values()
        got = {"w": torch.zeros(16_000)}
        dcp.load(got, storage_reader=dcp.FileSystemReader(path))
        print(json.dumps({"error": type(cause).__name__, "message": str(cause),
                          "old_loads": bool((got["w"] == 1).all()),
                          "old_verifies": verify_checkpoint(path).ok}))
    """
)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
@pytest.mark.parametrize("direct_io", ["", "1"], ids=["buffered", "o_direct"])
def test_a_real_full_tmpfs_says_space(tmp_path, direct_io):
    """A 256 KiB tmpfs, mounted in a private mount namespace (gone with the process):
    the overwrite of a 64 KB checkpoint by an 800 KB one runs out of space, whether the
    data files are written buffered (a tmpfs's default) or ``O_DIRECT`` (forced)."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "save.py"
    script.write_text(_TMPFS_SAVE)
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=256k tmpfs {mount} && exec {sys.executable} {script} {mount}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "FSDP_EXT_DIRECT_IO": direct_io},
    )
    if "mount:" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] == "CheckpointSpaceError", result
    assert "no space left on the device" in result["message"]
    assert "needs room for both" in result["message"]
    assert result["old_loads"] and result["old_verifies"]
    assert os.listdir(mount) == []  # the tmpfs lived only in the child's namespace


# -- checksums ---------------------------------------------------------------------------------


def test_a_manifest_without_checksums_does_not_vouch_for_a_flipped_byte(tmp_path):
    """Saved with checksums=False, or "crc32" edited to "none": a flipped data byte must not
    verify ok nor load silently through the verified reader."""
    for how in ("checksums=False", "edited"):
        path = save(tmp_path / how, checksums=how == "edited")
        root = version(path)
        if how == "edited":
            manifest = json.loads((root / ".manifest.json").read_text())
            manifest["checksum"] = "none"
            (root / ".manifest.json").write_text(seal(manifest, SELF_CHECKSUM))
        data_file = root / "__0_other.distcp"
        data = bytearray(data_file.read_bytes())
        data[len(data) // 2] ^= 0x40
        data_file.write_bytes(bytes(data))
        report = verify_checkpoint(path)
        assert not report.ok
        assert any("records no checksums" in p for p in report.problems), report.problems
        with logged_metadata_errors() as logged, pytest.raises(CheckpointException) as err:
            load(path)
        assert "records no checksums" in error_text(err.value, logged)
        assert isinstance(_integrity(path), CheckpointIntegrityError)


def _integrity(path: Path) -> BaseException:
    with pytest.raises(CheckpointIntegrityError) as err:
        VerifiedFileSystemReader(path).read_metadata()
    return err.value


def test_sizes_are_checked_without_checksums(tmp_path):
    """The opt-in: require_checksums=False loads on sizes alone, and a grown file is named."""
    path = save(tmp_path / "ckpt", checksums=False)
    assert torch.equal(load(path, require_checksums=False)["embed"], state()["embed"])
    assert verify_checkpoint(path, require_checksums=False).ok
    data_file = version(path) / "__0_other.distcp"
    data_file.write_bytes(data_file.read_bytes() + b"\0")
    size = data_file.stat().st_size
    report = verify_checkpoint(path, require_checksums=False)
    assert report.problems == [
        f"{data_file}: size {size} bytes, the manifest expects {size - 1} "
        "(truncated or overwritten)"
    ]
    with pytest.raises(CheckpointException) as err:
        load(path, require_checksums=False)
    assert f"{data_file}: size {size} bytes" in str(err.value)


class _ReplaceAfterOpening(SafeLoadPlanner):
    """Once the reader has opened the checkpoint (after ``.metadata``, before any data
    file), removes it (a prune of another job) or saves other values over it (a later save,
    publishing by a directory swap: the path itself stays the same directory name)."""

    def __init__(self, path: Path, how: str):
        super().__init__()
        self.path, self.how = path, how

    def create_local_plan(self):
        if self.how == "prune":
            remove_checkpoint(self.path)
        else:
            save(self.path, state(seed=1), fs=LocalStorage(swap=True))
        return super().create_local_plan()


@pytest.mark.parametrize("how", ["prune", "overwrite"])
def test_a_checkpoint_removed_while_being_read_says_so(tmp_path, how):
    """Every file comes from the directory the reader opened, never from what is at the
    path by the time it reads."""
    path = save(tmp_path / "ckpt")
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in state().items()}
    reader = VerifiedFileSystemReader(path)
    with pytest.raises(CheckpointException) as err:
        dcp.load(got, storage_reader=reader, planner=_ReplaceAfterOpening(path, how))
    error = cause(err)
    assert isinstance(error, CheckpointIntegrityError)
    assert "was removed while being read (pruned, or replaced by a later save)" in str(error)
    assert path.exists() == (how == "overwrite")


def test_a_reader_refuses_what_is_not_a_storage():
    with pytest.raises(TypeError, match="fs must be a CheckpointStorage"):
        VerifiedFileSystemReader("x", fs=object())
