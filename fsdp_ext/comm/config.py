"""Configuration of the compressed gradient communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_ext.comm.registry import CODECS, make_codec
from fsdp_ext.node_size import resolve_node_size

ERROR_DTYPES = (torch.int8, torch.bfloat16, torch.float32)

#: the codec a config names by default (and the only one before codecs had names)
DEFAULT_CODEC = "absmax"


@dataclass(frozen=True)
class LoCoConfig:
    """Settings of LoCo gradient compression (ZeRO++ qgZ with LoCo error feedback).

    ``err_beta`` and ``reset_interval`` are ZeRO++'s ``zeropp_loco_param = {err_beta, reset_T}``.
    ``error_feedback=False`` turns LoCo off and leaves plain absmax quantisation (qgZ).
    ``intra_node_size=k`` reduces in full precision among the ranks of each node (global rank
    ``g`` sits on node ``g // k``) and quantises only the exchange between nodes;
    ``"auto"`` takes ``k`` from the launcher's ``LOCAL_WORLD_SIZE``, so a job on a single node
    sends full precision (there is no scarce link to save).
    ``codec`` names the wire format in :data:`fsdp_ext.comm.registry.CODECS`; the default,
    ``"absmax"``, is the LoCo / qgZ codec that the other fields describe (``bits`` 4 or 8).
    Which values of ``bits`` (and of the other fields a codec reads) are valid is the
    codec's to say: the config builds it once here and reports its refusal.
    """

    bits: int = 4
    group_size: int = 128
    err_beta: float = 0.8
    reset_interval: int = 1024
    error_dtype: torch.dtype = torch.int8
    intra_node_size: int | str | None = None
    error_feedback: bool = True
    codec: str = DEFAULT_CODEC

    def __post_init__(self) -> None:
        gs = self.group_size
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 32 or gs & (gs - 1):
            raise ValueError(f"group_size must be a power of two >= 32, got {gs!r}")
        beta = self.err_beta
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0 <= beta < 1:
            raise ValueError(f"err_beta must be a number with 0 <= err_beta < 1, got {beta!r}")
        ri = self.reset_interval
        if not isinstance(ri, int) or isinstance(ri, bool) or ri < 1:
            raise ValueError(f"reset_interval must be an int >= 1, got {ri!r}")
        if self.error_dtype not in ERROR_DTYPES:
            raise ValueError(
                f"error_dtype must be one of torch.int8, torch.bfloat16, torch.float32, "
                f"got {self.error_dtype!r}"
            )
        k = self.intra_node_size
        bad_int = not isinstance(k, int) or isinstance(k, bool) or k < 1
        if k != "auto" and k is not None and bad_int:
            raise ValueError(f"intra_node_size must be None, 'auto' or an int >= 1, got {k!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {sorted(CODECS)}, got {self.codec!r}")
        self._check_codec()

    def _check_codec(self) -> None:
        """Ask the codec what it accepts: building it checks the settings it reads (the
        absmax codec takes ``bits`` 4 or 8; another codec its own), and its ``check_device``
        refuses a setting its CUDA kernels cannot run (a group size they are not built for).
        Both happen here, before any worker starts, so the same config runs on CPU and GPU
        alike and never fails at registration or in the first backward."""
        try:
            codec = make_codec(self.codec, self)
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"codec={self.codec!r} cannot be built from this LoCoConfig: {exc}"
            ) from exc
        try:
            codec.check_device(torch.device("cuda"))
        except ValueError as exc:
            raise ValueError(
                f"LoCoConfig: {exc} (the CUDA kernels' limit, checked on every device)"
            ) from exc

    def node_size(self) -> int | None:
        """Ranks per node: ``intra_node_size`` resolved (``"auto"`` reads ``LOCAL_WORLD_SIZE``)."""
        if self.intra_node_size is None:
            return None
        return resolve_node_size(self.intra_node_size)
