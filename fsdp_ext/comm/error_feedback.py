"""The LoCo error buffer of one reduction site."""

from __future__ import annotations

import torch

from fsdp_ext.comm.config import LoCoConfig


class ErrorFeedback:
    """Holds ``e`` (and its per-group scales when int8) for one reduction site.

    Allocated on first use; zeroed every ``reset_interval`` reductions, as in ZeRO++
    (``reset_T``), so a stale error cannot outlive a change in the gradient statistics.
    """

    def __init__(self, config: LoCoConfig):
        self.config = config
        self.error: torch.Tensor | None = None
        self.error_scales: torch.Tensor | None = None
        self.reductions = 0

    def materialize(self, numel: int, device: torch.device) -> None:
        if self.error is not None:
            if self.error.numel() != numel:
                raise RuntimeError(
                    f"error buffer holds {self.error.numel()} elements but this reduction "
                    f"needs {numel}: one LoCo comm object must serve one FSDP param group"
                )
            return
        self.error = torch.zeros(numel, dtype=self.config.error_dtype, device=device)
        if self.config.error_dtype == torch.int8:
            self.error_scales = torch.zeros(
                numel // self.config.group_size, dtype=torch.float32, device=device
            )

    def next(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The buffers to use for the coming reduction (reset first when due)."""
        self.materialize(numel, device)
        if self.reductions and self.reductions % self.config.reset_interval == 0:
            self.reset()
        self.reductions += 1
        return self.error, self.error_scales

    def reset(self) -> None:
        if self.error is not None:
            self.error.zero_()
        if self.error_scales is not None:
            self.error_scales.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"reductions": torch.tensor(self.reductions, dtype=torch.int64)}
        if self.error is not None:
            state["error"] = self.error
        if self.error_scales is not None:
            state["error_scales"] = self.error_scales
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.reductions = int(state["reductions"])
        for name in ("error", "error_scales"):
            if name not in state:
                continue
            current = getattr(self, name)
            if current is None:
                setattr(self, name, state[name].clone())
            elif current is not state[name]:
                current.copy_(state[name])
