"""Where each parameter's slice sits in one rank chunk of a unit's reduce-scatter.

FSDP2 hands the reduce-scatter a rank-major ``[W * shard]`` input: row ``r`` is the r-th dim-0
chunk of every parameter *that has a gradient*, concatenated in parameter order. Parameters
without a gradient (an unused branch, an idle expert) are left out, so the columns of a row
depend on which parameters are present. :class:`ParamLayout` maps the columns of any such
reduction to the columns of the full layout, where each parameter's error lives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

Present = tuple[int, ...]


class ParamLayout:
    """Per-parameter segment lengths of one rank chunk, in FSDP's parameter order."""

    def __init__(self, names: Sequence[str], lengths: Sequence[int]):
        if len(names) != len(lengths):
            raise ValueError("names and lengths must have the same length")
        self.names = tuple(names)
        self.lengths = tuple(int(n) for n in lengths)
        offsets, total = [], 0
        for n in self.lengths:
            offsets.append(total)
            total += n
        self.offsets = tuple(offsets)
        self.width = total
        self.all_present: Present = tuple(range(len(self.names)))
        self._columns: dict[tuple[Present, torch.device], torch.Tensor] = {}
        self._widths: dict[Present, int] = {}
        self._scatter: dict[tuple[Present, int, torch.device], torch.Tensor] = {}

    def width_of(self, present: Present) -> int:
        """Elements per row of a reduction holding the parameters ``present``."""
        if present not in self._widths:
            self._widths[present] = sum(self.lengths[i] for i in present)
        return self._widths[present]

    def columns(self, present: Present, device: torch.device) -> torch.Tensor:
        """``cols[j]``: the full-layout column of column ``j`` of a ``present`` reduction."""
        key = (present, torch.device(device))
        if key not in self._columns:
            parts = [
                torch.arange(self.offsets[i], self.offsets[i] + self.lengths[i]) for i in present
            ]
            cols = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            self._columns[key] = cols.to(device)
        return self._columns[key]

    def split(self, parts: int) -> ParamLayout:
        """The layout of one of ``parts`` slices that cut every parameter's segment evenly
        (padded), as FSDP cuts parameters on dim 0: slice ``r`` of a reduction then holds
        only pieces of slice ``r`` of the full layout, whichever parameters are present."""
        return ParamLayout(self.names, [-(-n // parts) for n in self.lengths])

    def slice_index(self, present: Present, parts: int, device: torch.device) -> torch.Tensor:
        """``[parts, sum of pieces]`` positions in a ``present`` chunk (of ``width_of``
        elements) of each slice's elements; the position ``width_of(present)`` means padding."""
        key = (present, parts, torch.device(device))
        if key not in self._scatter:
            numel = self.width_of(present)
            rows = []
            for r in range(parts):
                row, start = [], 0
                for i in present:
                    n = self.lengths[i]
                    piece = -(-n // parts)
                    pos = torch.arange(r * piece, (r + 1) * piece)
                    pos = torch.where(pos < n, pos + start, torch.full_like(pos, numel))
                    row.append(pos)
                    start += n
                rows.append(torch.cat(row) if row else torch.zeros(0, dtype=torch.int64))
            self._scatter[key] = torch.stack(rows).to(device)
        return self._scatter[key]

    def signature(self) -> str:
        """A short digest of names and lengths: equal iff a saved error fits this layout."""
        text = "\n".join(f"{n}:{m}" for n, m in zip(self.names, self.lengths, strict=True))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def names_of(self, present: Present) -> list[str]:
        return [self.names[i] for i in present]
