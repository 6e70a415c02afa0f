"""What verifying a checkpoint found: one line per problem, naming the file or object.

Shared by the POSIX check (``verify.py``) and the blob check (``blob_verify.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_ext.checkpoint.manifest import FileRecord

__all__ = ["CheckpointReport"]


@dataclass
class CheckpointReport:
    """``ok`` when complete and every checksum matches; ``problems`` has one line each.

    ``version`` is the version directory the path links to (None for a plain directory),
    ``save_id`` the save that wrote it; ``notes`` describe what else is beside it.
    """

    path: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, FileRecord] = field(default_factory=dict)
    bytes_per_rank: dict[int, int] = field(default_factory=dict)
    tensors: int = 0
    version: str | None = None
    save_id: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        total = sum(self.bytes_per_rank.values())
        state = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        where = f" -> {self.version}" if self.version else ""
        saved = f" (save {self.save_id})" if self.save_id else ""
        return (
            f"{self.path}{where}{saved}: {state}; {len(self.files)} files, {total} bytes, "
            f"{self.tensors} tensors, {len(self.bytes_per_rank)} ranks"
        )

    def table(self) -> str:
        lines = ["rank  bytes"]
        lines += [f"{r:4d}  {b}" for r, b in sorted(self.bytes_per_rank.items())]
        lines.append("file  rank  bytes  layers")
        for name, rec in sorted(self.files.items()):
            lines.append(f"{name}  {rec.rank}  {rec.size}  {','.join(rec.layers) or '-'}")
        return "\n".join(lines)
