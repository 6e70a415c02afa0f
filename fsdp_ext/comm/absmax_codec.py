"""The absmax codecs: symmetric absmax per group, 4 or 8 bits; ``loco`` keeps LoCo error
feedback, ``q4`` (ZeRO++'s qgZ) does not. Each has its own options dataclass here
(:class:`LoCoConfig`, :class:`Q4Config`), and the codec, not the config, says which values
are valid: a config builds its codec when it is made and reports the codec's refusal.

Format and rounding are specified in :mod:`fsdp_ext.kernels.codec_common`; the work runs in
the ``quantize_ef`` and ``dequantize_reduce`` kernels (Triton on CUDA, the fast torch path on
CPU, the reference when forced; see :mod:`fsdp_ext.kernels.backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fsdp_ext.comm.codec import Codec, Feedback
from fsdp_ext.kernels.codec_common import ERROR_QMAX, TRITON_GROUP_SIZES, payload_chunk_bytes
from fsdp_ext.kernels.dequantize_reduce import dequantize_reduce_from_payload
from fsdp_ext.kernels.quantize_ef import quantize_ef_to_payload

__all__ = ["AbsmaxCodec", "LoCoConfig", "Q4Config"]

ERROR_DTYPES = (torch.int8, torch.bfloat16, torch.float32)


class AbsmaxCodec(Codec):
    """``s = absmax / qmax`` per group of ``group_size``, ``q = clamp(floor(h / s + 0.5))``.

    With ``error_feedback`` the codec is LoCo: it sends ``h = g + e`` and keeps
    ``e <- beta e + (1 - beta)(h - q s)`` in ``error_dtype`` (int8 with one fp32 scale per
    group, bf16 or fp32). Without it, it is plain qgZ, and also a block-wise weight codec
    (``AbsmaxCodec(bits=8, group_size=256)``).
    """

    format_keys = ("bits", "error_dtype")

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 128,
        *,
        err_beta: float = 0.0,
        error_dtype: torch.dtype = torch.int8,
        error_feedback: bool = False,
        reset_interval: int | None = None,
    ):
        if isinstance(bits, bool) or bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        gs = group_size
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 8 or gs & (gs - 1):
            raise ValueError(f"group_size must be a power of two >= 8, got {gs!r}")
        if error_dtype not in ERROR_DTYPES:
            raise ValueError(
                f"error_dtype must be torch.int8, torch.bfloat16 or torch.float32, got "
                f"{error_dtype!r}"
            )
        beta = err_beta
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0 <= beta < 1:
            raise ValueError(f"err_beta must be a number with 0 <= err_beta < 1, got {beta!r}")
        ri = reset_interval
        if ri is not None and (not isinstance(ri, int) or isinstance(ri, bool) or ri < 1):
            raise ValueError(f"reset_interval must be an int >= 1, got {ri!r}")
        self.bits = bits
        self.group_size = group_size
        self.err_beta = float(err_beta)
        self.error_dtype = error_dtype
        self.error_feedback = bool(error_feedback)
        self.reset_interval = reset_interval

    @classmethod
    def from_config(cls, config: LoCoConfig | Q4Config) -> AbsmaxCodec:
        """From a :class:`LoCoConfig` (error feedback) or a :class:`Q4Config` (none)."""
        if isinstance(config, Q4Config):
            return cls(config.bits, config.group_size)
        return cls(
            config.bits,
            config.group_size,
            err_beta=config.err_beta,
            error_dtype=config.error_dtype,
            error_feedback=True,
            reset_interval=config.reset_interval,
        )

    @property
    def keeps_feedback(self) -> bool:
        return self.error_feedback

    def groups(self, numel: int) -> int:
        return -(-numel // self.group_size)

    def padded(self, numel: int) -> int:
        return self.groups(numel) * self.group_size

    def payload_bytes(self, numel: int) -> int:
        return payload_chunk_bytes(self.groups(numel), self.group_size, self.bits)

    def encode(
        self, rows: torch.Tensor, payload: torch.Tensor, feedback: Feedback | None = None
    ) -> None:
        error = error_scales = None
        beta = 0.0
        if feedback is not None:
            error, error_scales, beta = feedback.error, feedback.error_scales, self.err_beta
        quantize_ef_to_payload(
            rows,
            payload,
            error,
            error_scales,
            group_size=self.group_size,
            bits=self.bits,
            beta=beta,
        )

    def decode_reduce(
        self, payload: torch.Tensor, out: torch.Tensor, *, out_scale: float = 1.0
    ) -> None:
        dequantize_reduce_from_payload(
            payload, out, group_size=self.group_size, bits=self.bits, out_scale=out_scale
        )

    def header(self) -> dict[str, object]:
        # the keys and value formats of every LoCo checkpoint so far: old ones still load
        return {
            "bits": self.bits,
            "error_dtype": str(self.error_dtype),
            "group_size": self.group_size,
            "err_beta": self.err_beta,
        }

    def check_device(self, device: torch.device) -> None:
        # the torch paths take any power of two; the CUDA kernels are tiled for a fixed set
        if torch.device(device).type == "cuda" and self.group_size not in TRITON_GROUP_SIZES:
            raise ValueError(
                f"on {device}, the absmax codec's Triton kernels take group_size in "
                f"{TRITON_GROUP_SIZES}; got group_size={self.group_size}"
            )

    def new_feedback(self, numel: int, device: torch.device) -> Feedback:
        if numel % self.group_size:
            raise ValueError(f"feedback covers whole groups of {self.group_size}, got {numel}")
        error = torch.zeros(numel, dtype=self.error_dtype, device=device)
        scales = None
        if self.error_dtype == torch.int8:
            scales = torch.zeros(numel // self.group_size, dtype=torch.float32, device=device)
        return Feedback(error, scales)

    def feedback_to_fp32(self, feedback: Feedback) -> torch.Tensor:
        error = feedback.error
        if error.dtype == torch.float32:
            return error
        e = error.float()
        if feedback.error_scales is not None:
            e = (e.view(-1, self.group_size) * feedback.error_scales.view(-1, 1)).view(-1)
        return e

    def feedback_from_fp32(self, feedback: Feedback, values: torch.Tensor) -> None:
        error = feedback.error
        if error.dtype == torch.float32:
            if values.data_ptr() != error.data_ptr():
                error.copy_(values)
            return
        if feedback.error_scales is None:
            error.copy_(values)  # round to nearest even, as the kernels do
            return
        groups = values.view(-1, self.group_size)
        scale = groups.abs().amax(dim=1, keepdim=True) / ERROR_QMAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.floor(groups / safe + 0.5).clamp_(-ERROR_QMAX, ERROR_QMAX)
        error.copy_(q.view(-1))
        feedback.error_scales.copy_(scale.view(-1))


def _checked(config: Any) -> None:
    """Build the codec a config describes, so the codec's own limits (and its CUDA kernels',
    checked on every device so a config runs alike on CPU and GPU) refuse bad values when the
    config is made, before any worker starts."""
    name = type(config).__name__
    try:
        codec = AbsmaxCodec.from_config(config)
        codec.check_device(torch.device("cuda"))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


@dataclass(frozen=True)
class LoCoConfig:
    """Options of the ``loco`` codec: 4-/8-bit absmax with LoCo error feedback (ZeRO++ qgZ
    plus LoCo). ``err_beta`` and ``reset_interval`` are ZeRO++'s ``zeropp_loco_param =
    {err_beta, reset_T}``; ``error_dtype`` stores the error (int8 with one fp32 scale per
    group, bf16 or fp32). Which values are valid is the codec's to say."""

    codec: ClassVar[str] = "loco"

    bits: int = 4
    group_size: int = 128
    err_beta: float = 0.8
    reset_interval: int = 1024
    error_dtype: torch.dtype = torch.int8

    def __post_init__(self) -> None:
        _checked(self)


@dataclass(frozen=True)
class Q4Config:
    """Options of the ``q4`` codec: 4-/8-bit absmax without error feedback (ZeRO++'s qgZ)."""

    codec: ClassVar[str] = "q4"

    bits: int = 4
    group_size: int = 128

    def __post_init__(self) -> None:
        _checked(self)
