"""The error-feedback buffer of one reduction site, kept in the unit's full parameter layout."""

from __future__ import annotations

import torch

from fsdp_ext.comm.codec import Codec, Feedback


class ErrorFeedback:
    """Holds ``e`` (and its per-group scales when the codec stores int8) for one reduction site.

    The buffer is ``[rows, width]`` in the layout where every trainable parameter of the
    unit is present; a reduction that leaves parameters out works on :meth:`subset`.
    Allocated on first use on the device the reduction runs on; zeroed every
    ``reset_interval`` reductions, as in ZeRO++ (``reset_T``), so a stale error cannot outlive
    a change in the gradient statistics. The codec decides how ``e`` is stored.
    """

    def __init__(self, codec: Codec, reset_interval: int | None = None):
        if not codec.keeps_feedback:
            raise ValueError(f"{type(codec).__name__} keeps no error feedback")
        self.codec = codec
        self.reset_interval = codec.reset_interval if reset_interval is None else reset_interval
        self.error: torch.Tensor | None = None
        self.error_scales: torch.Tensor | None = None
        self.reductions = 0

    @property
    def state(self) -> Feedback:
        return Feedback(self.error, self.error_scales)

    def materialize(self, numel: int, device: torch.device) -> None:
        """Allocate (zeros) or check the buffer; move it to ``device`` if it lives elsewhere
        (a checkpoint loaded on CPU, or a meta placeholder that never held values)."""
        device = torch.device(device)
        if self.error is not None:
            if self.error.numel() != numel:
                raise RuntimeError(
                    f"error buffer holds {self.error.numel()} elements but this reduction "
                    f"needs {numel}: one LoCo comm object must serve one FSDP param group "
                    "(install it with fsdp_ext.comm.enable or LoCoReduceScatter.install)"
                )
            if self.error.device != device:
                self._move(device)
            return
        fresh = self.codec.new_feedback(numel, device)
        self.error, self.error_scales = fresh.error, fresh.error_scales

    def _move(self, device: torch.device) -> None:
        for name in ("error", "error_scales"):
            t = getattr(self, name)
            if t is not None:
                moved = torch.zeros_like(t, device=device) if t.is_meta else t.to(device)
                setattr(self, name, moved)

    def tick(self) -> None:
        """Count one reduction; reset first when one is due."""
        if self.reset_interval and self.reductions and self.reductions % self.reset_interval == 0:
            self.reset()
        self.reductions += 1

    def next(self, numel: int, device: torch.device) -> Feedback:
        """The buffers to use for the coming reduction (reset first when due)."""
        self.materialize(numel, device)
        self.tick()
        return self.state

    def subset(self, rows: int, full_width: int, columns: torch.Tensor, width: int) -> ErrorSubset:
        """The view of a reduction whose row column ``j`` is full-layout column ``columns[j]``."""
        return ErrorSubset(self, rows, full_width, columns, width)

    def decoded(self) -> torch.Tensor:
        """The error as fp32 (a view of the buffer itself when it is fp32)."""
        return self.codec.feedback_to_fp32(self.state)

    def encode(self, values: torch.Tensor) -> None:
        """Store fp32 ``values`` back in the buffer's dtype, as the codec would."""
        self.codec.feedback_from_fp32(self.state, values)

    def reset(self) -> None:
        if self.error is not None:
            self.error.zero_()
        if self.error_scales is not None:
            self.error_scales.zero_()

    def forget(self) -> None:
        """Drop the buffers and the reduction count (an elastic resume starts afresh)."""
        self.error = self.error_scales = None
        self.reductions = 0

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
            if current is None or current.shape != state[name].shape or current.is_meta:
                setattr(self, name, state[name].clone())
            elif current is not state[name]:
                current.copy_(state[name])


class ErrorSubset:
    """The error entries of the parameters one reduction holds, as an fp32 buffer in that
    reduction's layout. :meth:`write_back` stores the codec's update in the full layout;
    parameters absent from the reduction keep their error untouched (up to int8 re-rounding
    of a group they share with present parameters)."""

    def __init__(
        self, parent: ErrorFeedback, rows: int, full_width: int, columns: torch.Tensor, width: int
    ):
        self.parent = parent
        self.rows, self.full_width, self.width = rows, full_width, width
        self.columns = columns
        self._full: torch.Tensor | None = None
        self._part: torch.Tensor | None = None

    @property
    def reductions(self) -> int:
        return self.parent.reductions

    def next(self, numel: int, device: torch.device) -> Feedback:
        if numel != self.rows * self.width:
            raise RuntimeError(f"error subset holds {self.rows * self.width} elements, not {numel}")
        self.parent.materialize(self.rows * self.full_width, device)
        self.parent.tick()
        self._full = self.parent.decoded().view(self.rows, self.full_width)
        part = torch.zeros(self.rows, self.width, dtype=torch.float32, device=device)
        part[:, : self.columns.numel()] = self._full[:, self.columns]
        self._part = part
        return Feedback(part.view(-1))

    def write_back(self) -> None:
        if self._part is None:
            return
        self._full[:, self.columns] = self._part[:, : self.columns.numel()]
        self.parent.encode(self._full.view(-1))
        self._full = self._part = None
