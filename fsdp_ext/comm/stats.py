"""Byte counters of the compressed communication."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    """What one rank put on the wire, next to what uncompressed collectives would have sent.

    ``bytes_sent`` counts the quantised payload (codes and scales) addressed to other ranks,
    recorded at the call site from the tensors handed to the collective.
    ``bytes_uncompressed`` is what the replaced collective sends for the same input in its
    own dtype (a ring reduce-scatter sends ``(W - 1) / W`` of its input; a ring all-reduce
    twice that). ``intra_node_bytes`` is the full-precision traffic of hierarchical mode.
    """

    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    intra_node_bytes: int = 0
    reductions: int = 0

    def add(self, other: CommStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_uncompressed += other.bytes_uncompressed
        self.intra_node_bytes += other.intra_node_bytes
        self.reductions += other.reductions

    @property
    def compression_ratio(self) -> float:
        """``bytes_sent / bytes_uncompressed`` (0 before any reduction)."""
        return self.bytes_sent / self.bytes_uncompressed if self.bytes_uncompressed else 0.0
