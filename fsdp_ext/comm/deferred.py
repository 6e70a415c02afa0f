"""Gradient exchanges that finish behind the next unit's backward.

FSDP2 calls a unit's reduce-scatter comm from the unit's post-backward and expects the output
filled when the call returns: on CPU its streams order nothing. In the common case it then
only takes views of the output as the sharded gradients, and nothing reads them before the
backward ends (:func:`fsdp_ext._torch.reduce_output_only_viewed` says when). So a comm may
start its exchange, return, and fill the output later: here, once the next unit's exchange
has started (two in flight at most), and at the latest when the backward finishes its graph. The
transfer then runs on the process group's threads while the unit before computes its
backward, as the weight all-gathers do in forward (``register_weight_all_gather(overlap=...)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from fsdp_ext._torch import backward_task_id, queue_backward_callback


class DeferredExchanges:
    """The exchanges started in this backward whose outputs are not filled yet."""

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work, Callable[[], None]]] = []
        self._drained_task = -1  # the backward whose end already drains the queue

    def add(self, work: dist.Work, finish: Callable[[], None]) -> None:
        """Finish the exchanges held so far, then hold ``work`` (a collective just started)
        until the next :meth:`add` or the backward's end waits for it and calls ``finish``
        (which fills the output). Called during a backward only."""
        self.drain()
        self._pending.append((work, finish))
        task = backward_task_id()
        if task != self._drained_task:
            self._drained_task = task
            queue_backward_callback(self.drain)

    def drain(self) -> None:
        """Wait for every pending exchange and fill its output, oldest first."""
        while self._pending:
            work, finish = self._pending.pop(0)
            work.wait()
            finish()


# One queue per process: FSDP's post-backwards of one backward run one after another on the
# autograd thread, whichever units (and comms) they belong to.
DEFERRED = DeferredExchanges()
