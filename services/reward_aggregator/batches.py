"""Batches of a faust stream's events that wait for their first event without polling.

faust's `Stream.take_events(n, within)` wakes every `within` seconds whether or not an event came:
with the join's 10 ms it woke a hundred times a second, and an idle aggregator spent 40 ms of CPU
a second on it (py-spy: half its samples in take_events' wait). Here a batch opens at its first
event, however long that takes, and closes once no event has come for `idle_s` (a burst read at
once is one batch, however long faust takes to hand its events over), `linger_s` after its first at
the latest, or as soon as it holds `max_events`.

A batch's events are acked only after the caller's loop body for that batch has finished, and
only if it finished: faust commits nothing the body has not done. A body may leave work running
past its end (`batch.after(future)`: its rows still being written): the batch is then acked once
that work has succeeded, and never if it failed, while the next batches go on. Batches are acked
in the order they were read, whatever order their work ends in: faust commits up to the first
run of acked offsets it finds, even one that starts after an unacked one (no committed offset yet,
or a gap of one), so a later batch acked first could commit past an earlier one. Events that arrive
while a batch is being handled start the next one (up to `max_events` of them; then the stream
waits), rather than waiting for the body to finish before they may be read.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class Batch(list):
    """One batch's events, and the work its body left running that must succeed before they are acked."""

    def __init__(self, events):
        super().__init__(events)
        self.unfinished: list[asyncio.Future] = []

    def after(self, work: asyncio.Future) -> None:
        self.unfinished.append(work)


async def batches(stream, max_events: int, linger_s: float, idle_s: float | None = None) -> AsyncIterator[Batch]:
    """The stream's events in lists of at most `max_events`, each closed once `idle_s` (default:
    `linger_s`) passes without an event, and `linger_s` after its first at the latest."""
    idle_s = linger_s if idle_s is None else min(idle_s, linger_s)
    loop = asyncio.get_running_loop()
    pending: list = []
    acking: set[asyncio.Task] = set()  # batches waiting for their body's unfinished work (held: tasks are weak)
    last_acking: asyncio.Future | None = None  # the latest of them: the next batch is acked after it

    async def ack_in_order(batch: Batch, before: asyncio.Future | None) -> bool:
        """Acks the batch once the batches read before it are acked and its work has succeeded;
        whether it was (a batch not acked holds back every later one: they are read again)."""
        if before is not None and not await before:
            return False
        try:
            await asyncio.gather(*batch.unfinished)
        except Exception:  # noqa: BLE001 -- not acked: faust commits none of it, a restart reads it again
            return False  # (the body waiting on the same work raises it)
        for event in batch:
            await stream.ack(event)
        return True

    opened = asyncio.Event()  # the next batch has its first event
    full = asyncio.Event()
    room = asyncio.Event()  # the next batch may take more events
    room.set()

    async def add(value):
        while not room.is_set():  # max_events are waiting already: hold the stream back
            await stream.wait(room)
        pending.append(stream.current_event)
        opened.set()
        if len(pending) >= max_events:
            full.set()
            room.clear()
        return value

    enable_acks = stream.enable_acks
    stream.enable_acks = False  # acked below, once the batch is handled
    stream.add_processor(add)
    # Consume in the background, through the processor (what take_events does; faust has no public
    # call for it): the stream's own iteration is not where the events are read.
    stream._enable_passive(aiter(stream.channel))
    try:
        while not stream.should_stop:
            if await stream.wait_for_stopped(opened):
                break
            closes = loop.time() + linger_s
            while not full.is_set() and (left := closes - loop.time()) > 0:
                seen = len(pending)
                await stream.wait_for_stopped(full, timeout=min(idle_s, left))
                if len(pending) == seen:
                    break  # none came meanwhile: the burst is over
            batch = Batch(pending)
            del pending[:]
            opened.clear()
            full.clear()
            room.set()
            if not batch:
                continue
            yield batch
            # Only once the caller asks for the next batch, i.e. its body finished: a body that raised or
            # was cancelled (a stop mid-batch) leaves its events unacked, so faust commits none of them
            # and they are read again (take_events acks them in a `finally`, whatever the body did).
            if batch.unfinished or (last_acking is not None and not last_acking.done()):
                last_acking = asyncio.ensure_future(ack_in_order(batch, last_acking))
                acking.add(last_acking)
                last_acking.add_done_callback(acking.discard)
                continue
            if last_acking is not None and not last_acking.result():
                continue  # an earlier batch failed: nothing after it is acked
            for event in batch:
                await stream.ack(event)
    finally:
        stream.enable_acks = enable_acks
        stream._processors.remove(add)
