"""The codec seam: how a compressed collective turns rows of values into bytes and back.

Every compressed collective of ``fsdp_ext.comm`` (the LoCo reduce-scatter, the exchange
between nodes in hierarchical mode, the HSDP all-reduce hook) moves **payloads** built by a
:class:`Codec` and knows nothing of their format. A new codec is one file holding a
``Codec`` subclass and the dataclass of its options, plus one line in
:data:`fsdp_ext.comm.registry.CODECS`; a codec's options and their limits are its own (the
options dataclass builds the codec to check them).

The contract, for ``W`` rows of ``n`` elements each:

**Payload.** A contiguous ``torch.uint8`` tensor of shape ``[W, payload_bytes(n)]``. Row
``w`` encodes input row ``w`` and nothing else, so a collective moves rows whole
(``all_to_all_single`` sends row ``w`` to rank ``w``; an all-gather stacks one row per
rank). ``payload_bytes(n)`` depends on ``n`` and the codec's settings only, never on values.

**Groups and padding.** A codec may work on groups of elements; ``padded(n)`` is the length
of a row once padded to whole groups (``n`` for a codec without groups). A group never
straddles two rows, so no rank's values depend on another rank's chunk.

**encode(rows, payload, feedback=None).** ``rows`` is ``[W, n]``, float32 or bfloat16, with
unit column stride (the row stride may be anything; ``n`` need not be a multiple of the
group). Writes every byte of ``payload``; reads nothing else. Without ``feedback`` it is a
pure function of ``rows`` (what a weight codec uses). With ``feedback`` (only when
:attr:`Codec.keeps_feedback`), the codec encodes ``rows + e``, where ``e`` is the feedback
decoded (:meth:`Codec.feedback_to_fp32`), and updates ``feedback`` in place with what it
wants added next time (LoCo: ``e <- beta e + (1 - beta)(h - deQ(Q(h)))``). The feedback
covers ``W * padded(n)`` elements, row ``w`` at ``[w * padded(n), (w + 1) * padded(n))``.
It arrives either in the codec's storage (as :meth:`Codec.new_feedback` made it) or as a
float32 ``error`` without scales (the path that leaves unused parameters out builds one);
a codec keeping feedback must accept both. The feedback is zeroed every
:attr:`Codec.reset_interval` reductions (None: never).

**decode_reduce(payload, out, *, out_scale=1.0).** ``out`` is a contiguous 1-D ``[n]``
float32 or bfloat16 tensor. Writes ``out = out_scale * sum_w decode(payload[w])``: the sum
in float32, in row order ``w = 0, 1, ...``, then one float32 multiplication by
``out_scale``, then one cast to ``out.dtype``. With ``W = 1`` this is plain decoding.

**decode(payload, out).** ``out`` is ``[W, n]`` (unit column stride): each row decoded on
its own, as ``decode_reduce`` of that single row with ``out_scale = 1`` would give. The
default does exactly that; a codec may override it with something faster.

**encode_unit(rows, payload, segments) / decode_unit(payload, out, segments).** The same for
rows cut into consecutive ``segments`` (one FSDP unit's parameters in its flat all-gather
buffer): no group mixes two segments, and the payload row is ``unit_payload_bytes(segments)``
bytes. The defaults encode and decode segment by segment into consecutive stretches of the
row; a codec with a kernel that takes the whole unit in one launch overrides all three (the
layout is then the codec's own).

**Non-finite values.** A NaN or Inf in an encoded row decodes to a non-finite value at that
position (a codec may widen it to the position's whole group), never to a finite one.

**Determinism.** Decoding is a pure function of the payload bytes: every rank that decodes
the same bytes gets the same values (HSDP replicas stay bit-identical).

**Never more bytes than the plain collective.** A codec's payload carries scales and pads
rows to whole groups, so for a small row (a norm's weight, a bias, a small model at a large
group size) it can exceed the values' own bytes. Every collective of ``fsdp_ext.comm`` asks
:func:`choose_wire` before it encodes: a unit whose payload would not be smaller than its
plain bytes in the collective's dtype is sent as is, uncompressed. The choice depends on the
sizes, the dtype and the codec's settings only, so every rank makes the same one without
talking; the handles expose it per unit (``CommHandle.wire_choices``,
``WeightGatherHandle.wire_choices``), so a cost model can count it.

**header().** Plain values (str, int, float, bool, None) that saved feedback must match to be
reused as is after a resume. A mismatch in one of :attr:`Codec.format_keys` means the saved
buffers cannot even be read (the load is refused); any other mismatch only makes them stale
(they are reset with a warning). The registry name is recorded next to the header by the
caller, so a checkpoint of another codec is always refused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["Codec", "Feedback", "WireChoice", "choose_wire"]


@dataclass
class Feedback:
    """The error-feedback buffers of one reduction site, as the codec stores them.

    ``error`` holds one entry per padded element, in the codec's storage dtype;
    ``error_scales`` holds one float32 scale per group when that storage needs them (int8
    errors), else None. They are also the names under which checkpoints save them.
    """

    error: torch.Tensor
    error_scales: torch.Tensor | None = None


class Codec(ABC):
    """One wire format; see the module docstring for the contract every method keeps."""

    #: header keys whose mismatch makes saved feedback unreadable (the load is refused)
    format_keys: ClassVar[tuple[str, ...]] = ()

    #: reductions between resets of the error feedback (None: never reset)
    reset_interval: int | None = None

    @property
    def keeps_feedback(self) -> bool:
        """Whether :meth:`encode` takes (and updates) error feedback."""
        return False

    def padded(self, numel: int) -> int:
        """Elements of a row of ``numel`` once padded to whole groups."""
        return numel

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Bytes of one payload row that encodes ``numel`` elements."""

    @abstractmethod
    def encode(
        self, rows: torch.Tensor, payload: torch.Tensor, feedback: Feedback | None = None
    ) -> None:
        """``[W, n]`` rows (plus decoded feedback) -> ``payload`` ``[W, payload_bytes(n)]``."""

    @abstractmethod
    def decode_reduce(
        self, payload: torch.Tensor, out: torch.Tensor, *, out_scale: float = 1.0
    ) -> None:
        """``out[:] = out_scale * sum_w decode(payload[w])`` (float32 sum in row order)."""

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """``out[w] = decode(payload[w])`` for every row ``w``."""
        if payload.shape[0] != out.shape[0]:
            raise ValueError(
                f"payload has {payload.shape[0]} rows but out has {out.shape[0]}; one per row"
            )
        for w in range(payload.shape[0]):
            self.decode_reduce(payload[w : w + 1], out[w])

    def unit_payload_bytes(self, segments: Sequence[int]) -> int:
        """Bytes of one payload row that encodes a row cut into ``segments``."""
        return sum(self.payload_bytes(numel) for numel in segments)

    def encode_unit(
        self, rows: torch.Tensor, payload: torch.Tensor, segments: Sequence[int]
    ) -> None:
        """``[W, n]`` rows cut into ``segments`` -> ``payload`` ``[W, unit_payload_bytes]``
        (no feedback: a unit's weights). The default encodes segment by segment."""
        for (start, numel), (at, width) in _stretches(self, segments):
            self.encode(rows[:, start : start + numel], payload[:, at : at + width])

    def decode_unit(
        self, payload: torch.Tensor, out: torch.Tensor, segments: Sequence[int]
    ) -> None:
        """``out[w]`` = row ``w`` of a :meth:`encode_unit` payload, decoded."""
        for (start, numel), (at, width) in _stretches(self, segments):
            self.decode(payload[:, at : at + width].contiguous(), out[:, start : start + numel])

    def header(self) -> dict[str, object]:
        """Settings that saved feedback must match to be reused (see the module docstring)."""
        return {}

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` (naming the setting and its allowed values) when this codec
        cannot run on ``device``; called at registration, before any collective. The
        default accepts every device."""
        return None

    def new_feedback(self, numel: int, device: torch.device) -> Feedback:
        """Zeroed feedback for ``numel`` padded elements (only when :attr:`keeps_feedback`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no error feedback")

    def feedback_to_fp32(self, feedback: Feedback) -> torch.Tensor:
        """The feedback as float32 values (the buffer itself when it already is float32)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no error feedback")

    def feedback_from_fp32(self, feedback: Feedback, values: torch.Tensor) -> None:
        """Store float32 ``values`` in ``feedback``, rounded as :meth:`encode` stores them."""
        raise NotImplementedError(f"{type(self).__name__} keeps no error feedback")


def _stretches(codec: Codec, segments: Sequence[int]) -> Iterator[tuple[tuple, tuple]]:
    """((start, numel) in the row, (offset, bytes) in the payload row) of each segment."""
    start = at = 0
    for numel in segments:
        width = codec.payload_bytes(numel)
        yield (start, numel), (at, width)
        start += numel
        at += width


@dataclass(frozen=True)
class WireChoice:
    """What one rank's row of one unit costs on the wire, encoded and plain, and which is sent.

    ``payload_bytes``: the codec's payload (codes, scales, padding); ``plain_bytes``: the
    same values in the collective's dtype. ``compressed`` is True only where the payload is
    strictly smaller.
    """

    compressed: bool
    payload_bytes: int
    plain_bytes: int

    @property
    def wire_bytes(self) -> int:
        """Bytes of the row actually sent."""
        return self.payload_bytes if self.compressed else self.plain_bytes


def choose_wire(codec: Codec, segments: Sequence[int], element_size: int) -> WireChoice:
    """Encode a row made of ``segments`` (elements each, encoded separately) only if that
    sends fewer bytes than the plain row of ``element_size``-byte values.

    A pure function of sizes and settings: every rank of a collective gets the same answer.
    """
    if element_size <= 0 or any(n < 0 for n in segments):
        raise ValueError(
            f"element_size must be > 0 and segments >= 0, got {element_size} and {list(segments)}"
        )
    payload = codec.unit_payload_bytes([n for n in segments if n])  # what encode_unit sends
    plain = sum(segments) * element_size
    return WireChoice(payload < plain, payload, plain)
