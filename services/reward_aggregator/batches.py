"""Batches of a faust stream's events that wait for their first event without polling.

faust's `Stream.take_events(n, within)` wakes every `within` seconds whether or not an event came:
with the join's 10 ms it woke a hundred times a second, and an idle aggregator spent 40 ms of CPU
a second on it (py-spy: half its samples in take_events' wait). Here a batch opens at its first
event, however long that takes, and closes `linger_s` later or as soon as it holds `max_events`.

A batch's events are acked only after the caller's loop body for that batch has finished, and
only if it finished: faust commits nothing the body has not done. Events that arrive
while a batch is being handled start the next one (up to `max_events` of them; then the stream
waits), rather than waiting for the body to finish before they may be read.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def batches(stream, max_events: int, linger_s: float) -> AsyncIterator[list]:
    """The stream's events in lists of at most `max_events`, each closed `linger_s` after its first."""
    pending: list = []
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
            if not full.is_set():
                await stream.wait_for_stopped(full, timeout=linger_s)
            batch = pending[:]
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
            for event in batch:
                await stream.ack(event)
    finally:
        stream.enable_acks = enable_acks
        stream._processors.remove(add)
