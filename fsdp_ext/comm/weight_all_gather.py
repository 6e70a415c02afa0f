"""The quantised parameter all-gather: an FSDP2 ``AllGather`` that sends int8 weights.

FSDP2 hands its all-gather comm the flat input of one unit (this rank's padded shard of
every parameter, concatenated, already cast to the param dtype) and the ``[W * n]`` output
it will copy the unsharded parameters from. This comm encodes the input with the config's codec
(:class:`~fsdp_ext.comm.blockwise_int8_codec.BlockwiseInt8Codec` by default) into one
payload row, each parameter's piece grouped on its own, so a quantisation group never mixes
two parameters (a norm's
weights near 1 next to a projection's near 0.02 would lose the projection's) nor two ranks'
shards; it all-gathers the payloads and decodes every rank's row, its own included, into the
output, so every rank computes with the same weights. Each side is one kernel launch per unit over
the flat buffer and its per-parameter offsets (:meth:`~fsdp_ext.comm.codec.Codec.encode_unit`),
whatever the number of parameters. The sharded parameters are never
touched: the optimizer keeps updating them in full precision.

Which gathers are quantised:
- forward gathers over the shard group, always;
- backward gathers over the shard group, if ``config.backward``;
- with ``backward=False``, never the gather of a unit that keeps its gathered weights from
  forward into backward (the root by default, any ``reshard_after_forward=False`` unit):
  backward computes with that copy, so it is gathered in full precision;
- gathers over a smaller group (hpZ: ``reshard_after_forward=<node size>``, the backward
  gather from the node-local copy) never: that copy holds the forward's dequantised
  weights already, and re-quantising them would change what forward computed with;
- a unit holding a non-float parameter (an int or bool tensor registered as a parameter)
  next to float ones: FSDP gathers the unit as bytes; its float parameters are still
  encoded, and the others' bytes travel as they are, after the codec's payload;
- a unit with no float parameter, or with float parameters of two dtypes, is gathered as is;
- a unit whose payload (codes, scales, padding to whole groups) would not be smaller than
  its plain bytes (a lone norm, biases, a small model at a large group size) is gathered as
  is: :func:`~fsdp_ext.comm.codec.choose_wire`, per unit, the same on every rank
  (:attr:`QuantizedWeightAllGather.wire`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_ext._torch import (
    AllGather,
    FSDPParamGroup,
    all_gather_into,
    fsdp_params,
    gather_dtype,
    gathering_for_backward,
    group_reshard_after_forward,
    padded_shard_numel,
    shard_process_group,
)
from fsdp_ext.comm.codec import Codec, WireChoice, choose_wire
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.comm.weight_config import WeightQuantConfig

__all__ = ["DecodeOnWait", "QuantizedWeightAllGather", "WeightGatherStats"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class WeightGatherStats:
    """What one rank sent in parameter all-gathers, counted at the call site.

    A ring all-gather sends each rank's contribution to its ``W - 1`` peers, so a gather
    of ``b`` bytes per rank counts ``(W - 1) * b``. ``bytes_sent``: quantised payloads;
    ``bytes_uncompressed``: what the stock gather would have sent for those gathers;
    ``full_precision_bytes``: gathers over the shard group left unquantised;
    ``intra_node_bytes``: hpZ's node-local backward gathers (always unquantised).
    """

    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    full_precision_bytes: int = 0
    intra_node_bytes: int = 0
    quantized_gathers: int = 0
    full_precision_gathers: int = 0
    intra_node_gathers: int = 0

    def add(self, other: WeightGatherStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def compression_ratio(self) -> float:
        """``bytes_sent / bytes_uncompressed`` of the quantised gathers (0 before any)."""
        return self.bytes_sent / self.bytes_uncompressed if self.bytes_uncompressed else 0.0


@dataclass(frozen=True)
class MixedUnitLayout:
    """A unit FSDP gathers as bytes (float parameters beside non-float ones), per rank row:
    each parameter's byte span, which spans are float (encoded, in ``dtype``) and which
    travel raw, and the wire choice for the float part plus the raw bytes."""

    spans: tuple[tuple[int, int], ...]  # (byte offset, bytes) of each parameter
    encoded: tuple[bool, ...]  # per parameter: a float one of ``dtype``
    dtype: torch.dtype
    segments: tuple[int, ...]  # elements of each encoded parameter, in order
    raw_bytes: int
    wire: WireChoice

    @property
    def payload_bytes(self) -> int:
        return self.wire.payload_bytes


class QuantizedWeightAllGather(AllGather):
    """FSDP2 ``AllGather`` of one unit (its param group): int8 on the wire (see module doc).

    Synchronous (returns ``None``) when FSDP calls it with ``async_op=False``; with
    ``async_op=True`` it returns a :class:`DecodeOnWait` after starting the transfer.
    """

    def __init__(
        self,
        config: WeightQuantConfig,
        group: FSDPParamGroup,
        fqn: str = "",
        *,
        codec: Codec | None = None,
    ):
        self.config = config
        self.codec: Codec = codec if codec is not None else make_codec(config)
        self.fqn = fqn
        self._group = group
        self._segment_cache: dict[int, tuple[int, ...]] = {}
        self._wire_cache: dict[tuple[int, torch.dtype], WireChoice] = {}
        self._mixed_cache: dict[int, MixedUnitLayout | None] = {}
        self.stats = WeightGatherStats()

    @property
    def unit_group(self) -> FSDPParamGroup:
        """The FSDP param group (unit) this comm gathers."""
        return self._group

    @property
    def wire(self) -> WireChoice:
        """This unit's choice for its shard-group gathers: every parameter's padded shard in
        the dtype FSDP gathers (the mixed-precision param dtype, else the parameter's)."""
        params = fsdp_params(self._group)
        dtypes = [gather_dtype(self._group, p) for p in params]
        if len(set(dtypes)) > 1:  # FSDP gathers bytes
            n = sum(padded_shard_numel(p) * d.itemsize for p, d in zip(params, dtypes, strict=True))
            mixed = self.mixed_layout(n)
            return mixed.wire if mixed is not None else WireChoice(False, n, n)
        n = sum(padded_shard_numel(p) for p in params)
        return self.wire_for(n, dtypes[0] if dtypes else torch.float32)

    def mixed_layout(self, n: int) -> MixedUnitLayout | None:
        """The byte layout of a flat uint8 input of ``n`` bytes (FSDP's gather of a unit
        with parameters of several dtypes), or None when there is nothing to encode: no
        float parameter, float parameters of two dtypes, or sizes that do not add up."""
        if n not in self._mixed_cache:
            params = fsdp_params(self._group)
            dtypes = [gather_dtype(self._group, p) for p in params]
            numels = [padded_shard_numel(p) for p in params]
            floats = {d for d in dtypes if d in FLOAT_DTYPES}
            total = sum(k * d.itemsize for k, d in zip(numels, dtypes, strict=True))
            layout = None
            if len(floats) == 1 and total == n:
                (dtype,) = floats
                spans, at = [], 0
                for k, d in zip(numels, dtypes, strict=True):
                    spans.append((at, k * d.itemsize))
                    at += k * d.itemsize
                encoded = tuple(d == dtype for d in dtypes)
                segments = tuple(k for k, e in zip(numels, encoded, strict=True) if e)
                raw = sum(b for (_, b), e in zip(spans, encoded, strict=True) if not e)
                float_wire = choose_wire(self.codec, segments, dtype.itemsize)
                wire = WireChoice(float_wire.compressed, float_wire.payload_bytes + raw, n)
                layout = MixedUnitLayout(tuple(spans), encoded, dtype, segments, raw, wire)
            self._mixed_cache[n] = layout
        return self._mixed_cache[n]

    def wire_for(self, n: int, dtype: torch.dtype) -> WireChoice:
        """Encoded or plain for a flat input of ``n`` elements in ``dtype`` (sizes only)."""
        key = (n, dtype)
        if key not in self._wire_cache:
            size = torch.empty((), dtype=dtype).element_size()
            self._wire_cache[key] = choose_wire(self.codec, self._segments(n), size)
        return self._wire_cache[key]

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self, n: int) -> tuple[int, ...]:
        """Each parameter's share of a flat input of ``n`` elements (FSDP's padded shards,
        in parameter order), so that no quantisation group mixes two parameters; the whole
        input as one segment if the sizes do not add up to ``n``."""
        if n not in self._segment_cache:
            sizes = tuple(padded_shard_numel(p) for p in fsdp_params(self._group))
            self._segment_cache[n] = sizes if sum(sizes) == n else (n,)
        return self._segment_cache[n]

    def _kind(self, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> str:
        """``"quantized"``, ``"full_precision"`` or ``"intra_node"`` for this gather."""
        if group is not shard_process_group(self._group):
            return "intra_node"  # hpZ: the post-forward group, inside a node
        if not self.config.backward and (
            gathering_for_backward(self._group)
            or not group_reshard_after_forward(self._group)  # backward reuses this copy
        ):
            return "full_precision"
        n = input_tensor.numel()
        if input_tensor.dtype in FLOAT_DTYPES:
            wire = self.wire_for(n, input_tensor.dtype)
        elif input_tensor.dtype == torch.uint8 and self.mixed_layout(n) is not None:
            wire = self.mixed_layout(n).wire  # float parameters beside non-float ones
        else:
            return "full_precision"
        if not wire.compressed:
            return "full_precision"  # the payload would be larger than the values
        return "quantized"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gather ``input_tensor`` of every rank into ``output_tensor``.

        ``async_op=False``: encode, gather, decode, then return ``None``. ``async_op=True``
        (FSDP's ``unshard_async_op``, which :func:`register_weight_all_gather` turns on):
        encode, start the gather and return a :class:`DecodeOnWait`, whose ``wait()`` (FSDP's
        copy-out, in the unit's own pre-forward or pre-backward) waits for it and decodes,
        so a prefetched unit's transfer runs behind the current unit's compute. The
        unquantised gathers return the collective's own ``Work``. Stats count at the call.
        """
        world, n = group.size(), input_tensor.numel()
        kind = self._kind(input_tensor, group)
        plain = (world - 1) * n * input_tensor.element_size()
        if kind in ("intra_node", "full_precision"):
            work = all_gather_into(output_tensor, input_tensor, group=group, async_op=async_op)
            if kind == "intra_node":
                self.stats.intra_node_bytes += plain
                self.stats.intra_node_gathers += 1
            else:
                self.stats.full_precision_bytes += plain
                self.stats.full_precision_gathers += 1
            return work if async_op else None
        if input_tensor.dtype == torch.uint8:
            width, work, decode = self._start_mixed(output_tensor, input_tensor, group, async_op)
        else:
            segments = self._segments(n)
            width = self.codec.unit_payload_bytes(segments)
            payload = torch.empty(1, width, dtype=torch.uint8, device=input_tensor.device)
            # input_tensor is this rank's slot of output_tensor: encode all of it before the
            # decoded rows overwrite it. One launch each way for the whole unit (with the
            # block-wise codec), read and written in place: no per-parameter copies.
            self.codec.encode_unit(input_tensor.view(1, n), payload, segments)
            gathered = torch.empty(world, width, dtype=torch.uint8, device=payload.device)
            work = all_gather_into(
                gathered.view(-1), payload.view(-1), group=group, async_op=async_op
            )

            def decode() -> None:
                self.codec.decode_unit(gathered, output_tensor.view(world, n), segments)

        self.stats.bytes_sent += (world - 1) * width
        self.stats.bytes_uncompressed += plain
        self.stats.quantized_gathers += 1
        if not async_op:
            decode()
            return None
        return DecodeOnWait(work, decode)

    def _start_mixed(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool,
    ) -> tuple[int, dist.Work | None, Callable[[], None]]:
        """The byte gather of a unit with non-float parameters: the float spans encoded as one
        unit, the others' bytes appended raw. Encodes and starts the gather; returns the
        payload row's bytes, the gather's ``Work`` (``None`` when synchronous) and the
        decode to run once it is done."""
        world, n = group.size(), input_tensor.numel()
        layout = self.mixed_layout(n)
        spans = [input_tensor[at : at + b] for at, b in layout.spans]
        floats = [t for t, e in zip(spans, layout.encoded, strict=True) if e]
        raws = [t for t, e in zip(spans, layout.encoded, strict=True) if not e]
        values = torch.cat(floats).view(layout.dtype)  # a copy: input is a slot of output
        encoded = layout.payload_bytes - layout.raw_bytes
        payload = torch.empty(1, layout.payload_bytes, dtype=torch.uint8, device=values.device)
        self.codec.encode_unit(values.view(1, -1), payload[:, :encoded], layout.segments)
        if raws:
            payload[0, encoded:] = torch.cat(raws)
        gathered = torch.empty(world, layout.payload_bytes, dtype=torch.uint8, device=values.device)
        work = all_gather_into(gathered.view(-1), payload.view(-1), group=group, async_op=async_op)

        def decode() -> None:
            decoded = torch.empty(world, values.numel(), dtype=layout.dtype, device=values.device)
            self.codec.decode_unit(gathered[:, :encoded], decoded, layout.segments)
            decoded_bytes = decoded.view(torch.uint8)
            out = output_tensor.view(world, n)
            float_at, raw_at = 0, encoded
            for (at, b), is_float in zip(layout.spans, layout.encoded, strict=True):
                if is_float:
                    out[:, at : at + b] = decoded_bytes[:, float_at : float_at + b]
                    float_at += b
                else:
                    out[:, at : at + b] = gathered[:, raw_at : raw_at + b]
                    raw_at += b

        return layout.payload_bytes, work, decode


class DecodeOnWait(dist.Work):
    """The ``Work`` an asynchronous quantised gather returns: ``wait()`` waits for the
    payload all-gather, then decodes every rank's row into FSDP's output (once; a second
    ``wait()`` only returns). FSDP2's copy-out calls ``wait()`` on whatever ``Work`` its
    all-gather comm returned, in the gathered unit's own pre-forward or pre-backward."""

    def __init__(self, work: dist.Work, decode: Callable[[], None]):
        super().__init__()
        self._work: dist.Work | None = work
        self._decode: Callable[[], None] | None = decode

    def wait(self, timeout: object = None) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        if self._decode is not None:
            decode, self._decode = self._decode, None
            decode()
        return True

    def is_completed(self) -> bool:
        return self._decode is None
