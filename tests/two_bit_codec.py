"""A 2-bit gradient codec written outside the library: this file and its one registry line
(:func:`register`) are all it takes for ``"two_bit"`` to be a ``CommConfig`` preset, a
``--comm`` choice of the main job and a ``--comm auto`` candidate, and for its options
(:class:`TwoBitConfig`) to run the reduce-scatter, the hierarchical exchange and the HSDP
hook. The codec owns its options and their limits; the library knows neither.

The tests call :func:`register` (and ``unregister_codec`` after), so the codec stays out of
the other tests' vocabulary; a program would run the line when it imports this file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fsdp_ext.comm import Codec, register_codec

CODES_PER_BYTE = 4  # 2 bits each, lowest first


class TwoBitCodec(Codec):
    """Per group of ``group_size``: ``s = absmax``, ``q = clamp(floor(h / s + 0.5), -1, 1)``
    sent as ``q + 2`` in 2 bits, then the group's float32 scale. Decoding gives ``q * s``.
    No error feedback."""

    def __init__(self, group_size: int):
        if group_size % (4 * CODES_PER_BYTE):
            raise ValueError(f"group_size must be a multiple of 16, got {group_size}")
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: TwoBitConfig) -> TwoBitCodec:
        return cls(config.group_size)

    def padded(self, numel: int) -> int:
        return -(-numel // self.group_size) * self.group_size

    def payload_bytes(self, numel: int) -> int:
        groups = self.padded(numel) // self.group_size
        return groups * (self.group_size // CODES_PER_BYTE + 4)

    def encode(self, rows, payload, feedback=None) -> None:
        w, n = rows.shape
        h = torch.zeros(w, self.padded(n))
        h[:, :n] = rows.float()
        groups = h.view(w, -1, self.group_size)
        scale = groups.abs().amax(dim=2, keepdim=True)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.floor(groups / safe + 0.5).clamp(-1, 1)
        codes = (q + 2).to(torch.uint8).view(w, -1, CODES_PER_BYTE)
        packed = codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6
        code_bytes = packed.shape[1]
        payload[:, :code_bytes] = packed
        payload[:, code_bytes:] = scale.view(w, -1).contiguous().view(torch.uint8)

    def decode_reduce(self, payload, out, *, out_scale=1.0) -> None:
        n = out.numel()
        groups = self.padded(n) // self.group_size
        code_bytes = groups * self.group_size // CODES_PER_BYTE
        packed = payload[:, :code_bytes]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
        codes = (packed.unsqueeze(-1) >> shifts) & 3
        q = codes.float().view(payload.shape[0], groups, self.group_size) - 2
        scale = payload[:, code_bytes:].contiguous().view(torch.float32)
        values = (q * scale.unsqueeze(-1)).view(payload.shape[0], -1)[:, :n]
        total = torch.zeros(n)
        for row in values:  # float32, in row order
            total += row
        out.copy_(total * torch.tensor(out_scale, dtype=torch.float32))

    def header(self) -> dict[str, object]:
        return {"bits": 2, "group_size": self.group_size}


@dataclass(frozen=True)
class TwoBitConfig:
    """The codec's options: values per fp32 scale (a multiple of 16, the codec says)."""

    codec: ClassVar[str] = "two_bit"

    group_size: int = 32

    def __post_init__(self) -> None:
        TwoBitCodec.from_config(self)  # the codec's own limits


def register() -> None:
    register_codec("two_bit", TwoBitCodec.from_config, options=TwoBitConfig)  # the one line
