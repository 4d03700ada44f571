"""The bus consumer's offset commits (bus.Commits), as logic: in order, one at a time, each taking what
was owed while the one before travelled. A real broker's side of it is in test_bus.py."""
from __future__ import annotations

import asyncio

import pytest

from crucible.shared import bus


class Broker:
    """Commits that land when told to (or fail), in the order they were sent."""

    def __init__(self):
        self.sent: list[dict] = []
        self.landing: list[asyncio.Future] = []

    async def commit(self, offsets):
        self.sent.append(dict(offsets))
        self.landing.append(asyncio.get_running_loop().create_future())
        await self.landing[-1]

    def land(self, index: int, failure: Exception | None = None):
        if failure is None:
            self.landing[index].set_result(None)
        else:
            self.landing[index].set_exception(failure)


async def ticks(n: int = 5):
    for _ in range(n):
        await asyncio.sleep(0)


async def test_batches_owed_while_a_commit_travels_go_together_as_soon_as_it_lands():
    broker = Broker()
    commits = bus.Commits(broker.commit)
    await commits.owe({("t", 0): 10})
    await ticks()
    assert broker.sent == [{("t", 0): 10}]
    await commits.owe({("t", 0): 20})
    await commits.owe({("t", 1): 5, ("t", 0): 30})
    await ticks()
    assert len(broker.sent) == 1  # one at a time
    broker.land(0)
    await ticks()  # no further batch, no flush: the owed offsets go when the first lands
    assert broker.sent[1] == {("t", 0): 30, ("t", 1): 5}
    broker.land(1)
    await commits.flush()
    assert len(broker.sent) == 2


async def test_the_consumer_waits_for_a_commit_that_does_not_land_after_so_many_batches():
    broker = Broker()
    commits = bus.Commits(broker.commit)
    await commits.owe({("t", 0): 1})
    await ticks()
    for offset in range(2, 1 + bus.COMMIT_BATCHES_BEHIND):
        await asyncio.wait_for(commits.owe({("t", 0): offset}), 1)  # owed, not waited for
    held = asyncio.ensure_future(commits.owe({("t", 0): 99}))
    await ticks()
    assert not held.done() and len(broker.sent) == 1
    broker.land(0)
    await asyncio.wait_for(held, 1)
    assert broker.sent[1] == {("t", 0): 99}
    # That commit carries COMMIT_BATCHES_BEHIND batches: the next batch waits for it, so that no more than
    # that many are ever uncommitted (what a crash reads again), counting those on their way.
    await ticks()
    held = asyncio.ensure_future(commits.owe({("t", 0): 100}))
    await ticks()
    assert not held.done()
    broker.land(1)
    await asyncio.wait_for(held, 1)
    assert broker.sent[2] == {("t", 0): 100}


async def test_a_wait_for_a_commit_cancelled_leaves_the_commit_on_its_way_for_settle():
    broker = Broker()
    commits = bus.Commits(broker.commit)
    await commits.owe({("t", 0): 1})
    await ticks()
    waiting = asyncio.ensure_future(commits.flush())
    await ticks()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not broker.landing[0].done()  # still on its way: the service stopping gives it a moment
    settling = asyncio.ensure_future(commits.settle())
    await ticks()
    broker.land(0)
    await asyncio.wait_for(settling, 1)
    assert broker.landing[0].done() and not broker.landing[0].cancelled()


async def test_a_failed_commit_is_raised_before_anything_later_is_sent_and_flush_raises_it_too():
    broker = Broker()
    commits = bus.Commits(broker.commit)
    await commits.owe({("t", 0): 1})
    await ticks()
    await commits.owe({("t", 0): 2})
    broker.land(0, RuntimeError("rebalanced"))
    await ticks()
    assert len(broker.sent) == 1  # what was owed is not sent after a failure
    with pytest.raises(RuntimeError, match="rebalanced"):
        await commits.flush()
    assert len(broker.sent) == 1


async def test_a_run_that_fails_drops_what_it_owes_and_the_commit_landing_after_sends_nothing_more():
    broker = Broker()
    commits = bus.Commits(broker.commit)
    await commits.owe({("t", 0): 1})
    await ticks()
    await commits.owe({("t", 0): 2})
    settling = asyncio.ensure_future(commits.settle())
    await ticks()
    broker.land(0)
    await settling
    await ticks()
    assert broker.sent == [{("t", 0): 1}]
