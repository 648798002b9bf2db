"""The scheduler thread: the one thread that drives a `BatchDecoder`.

HTTP handlers run on the event loop; the decoder is not thread-safe and its `step()` blocks for
a whole decode step, so it lives on a thread of its own. Handlers `submit` requests into a
bounded waiting queue (full: `QueueFull` at once, never a wait) and `cancel` them (client gone,
stop string found); the thread loops:

    apply cancels -> admit waiting requests while len(decoder) < max_batch -> step() -> deliver events

`deliver` callbacks run on the scheduler thread; the app's hands each item to its event loop
(`loop.call_soon_threadsafe`). A request's items are its `StepEvent`s, the last one with
`finished=True`, or one exception instead: the `UserError` of `add` (bad input, answered 400) or
the exception of a failed step (a bug, answered 500).

Grouping by block size happens inside `BatchDecoder.step()` (an engine runs one profile per
call, so one target forward serves the requests that chose the same block size); the scheduler
only bounds how many requests are in the decoder at once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from blockpilot.errors import UserError

log = logging.getLogger("blockpilot.serving")


class QueueFull(Exception):
    """The waiting queue holds `max_queue` requests already."""


class ShuttingDown(Exception):
    """The scheduler is draining or stopped and takes no new requests."""


@dataclasses.dataclass(eq=False)
class Ticket:
    """One submitted request. `request_id` is the decoder's id once admitted."""

    request: object  # a batching.GenerationRequest
    deliver: Callable[[object], None]
    request_id: int | None = None
    cancelled: bool = False


class Scheduler:
    """Owns `decoder` on its own thread once `start`ed.

    Args:
        decoder: a `BatchDecoder` (used only by the scheduler thread after `start`).
        max_batch: at most this many requests in the decoder at once.
        max_queue: at most this many requests waiting for a slot; `submit` raises `QueueFull` beyond.
        metrics: a `ServerMetrics`, or None.
    """

    def __init__(self, decoder, *, max_batch: int, max_queue: int, metrics=None):
        if max_batch < 1 or max_queue < 0:
            raise UserError(f"max_batch must be >= 1 and max_queue >= 0 (got {max_batch}, {max_queue})")
        self.decoder = decoder
        self.max_batch, self.max_queue, self.metrics = max_batch, max_queue, metrics
        self._cond = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._cancels: list[Ticket] = []
        self._running: dict[int, Ticket] = {}
        self._closing = False
        self._active = 0  # len(decoder) as last seen by the scheduler thread
        self._thread = threading.Thread(target=self._loop, name="blockpilot-scheduler", daemon=True)

    # ---------------------------------------------------------------- any thread

    def start(self) -> None:
        self._thread.start()

    def submit(self, request, deliver: Callable[[object], None]) -> Ticket:
        """Queue `request`; its items go to `deliver` (called on the scheduler thread).

        Raises:
            QueueFull: `max_queue` requests are waiting already (beyond those that free decoder
                slots will take at once).
            ShuttingDown: `close` was called.
        """
        with self._cond:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue + self._free_slots():
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds {self.max_queue})")
            ticket = Ticket(request, deliver)
            self._waiting.append(ticket)
            self._set_queue_gauge()
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop `ticket`: from the queue at once, or from the decoder before its next step. No
        more items are delivered for it. Idempotent."""
        with self._cond:
            if ticket.cancelled:
                return
            ticket.cancelled = True
            try:
                self._waiting.remove(ticket)
            except ValueError:
                self._cancels.append(ticket)
                self._cond.notify()
            self._set_queue_gauge()

    def close(self, timeout: float | None = None) -> bool:
        """Stop taking requests, let the admitted and waiting ones finish, stop the thread.

        Returns:
            True when the thread ended within `timeout` seconds (None: wait as long as it takes).
        """
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests in the decoder, as the scheduler thread last counted them (`len(decoder)`)."""
        return self._active

    @property
    def closing(self) -> bool:
        return self._closing

    # ---------------------------------------------------------------- the scheduler thread

    def _free_slots(self) -> int:
        return max(0, self.max_batch - len(self._running))

    def _set_queue_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_length.set(len(self._waiting))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._cancels or self._running or self._closing):
                    self._cond.wait()
                if self._closing and not (self._waiting or self._cancels or self._running):
                    return
            self._apply_cancels()
            self._admit_waiting()
            self._apply_cancels()  # a request cancelled while others were prefilled
            if self._running:
                self._step()
            self._count_active()

    def _apply_cancels(self) -> None:
        with self._cond:
            cancels, self._cancels = self._cancels, []
        for ticket in cancels:
            if ticket.request_id is not None and self._running.pop(ticket.request_id, None) is not None:
                self.decoder.cancel(ticket.request_id)
        if cancels:
            self._count_active()

    def _admit_waiting(self) -> None:
        while True:
            with self._cond:
                if not self._waiting or len(self.decoder) >= self.max_batch:
                    return
                ticket = self._waiting.popleft()
                self._set_queue_gauge()
            try:
                ticket.request_id = self.decoder.add(ticket.request)
            except UserError as exc:
                ticket.deliver(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug in the decoder: this request fails, the server goes on
                log.exception("BatchDecoder.add failed")
                ticket.deliver(exc)
                continue
            self._running[ticket.request_id] = ticket
            self._count_active()

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            events = self.decoder.step()
        except Exception as exc:  # noqa: BLE001 - a bug: fail the requests in the step, keep serving
            log.exception("BatchDecoder.step failed; failing its %d requests", len(self._running))
            for request_id, ticket in list(self._running.items()):
                self._running.pop(request_id)
                self._cancel_quietly(request_id)
                ticket.deliver(exc)
            return
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - start)
            self.metrics.step_requests.observe(len(events))
        for event in events:
            ticket = self._running.get(event.request_id)
            if ticket is None:
                continue
            if event.finished:
                del self._running[event.request_id]
            if not ticket.cancelled:
                ticket.deliver(event)

    def _cancel_quietly(self, request_id: int) -> None:
        try:
            self.decoder.cancel(request_id)
        except Exception:  # noqa: BLE001 - the decoder already failed; freeing is best effort
            log.exception("BatchDecoder.cancel failed after a failed step")

    def _count_active(self) -> None:
        self._active = len(self.decoder)
        if self.metrics is not None:
            self.metrics.active.set(self._active)
