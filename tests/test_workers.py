"""crucible.shared.workers: a worker that dies, hangs or is dropped mid-request is replaced; the pool keeps serving."""
from __future__ import annotations

import asyncio
import sys

import pytest

from crucible.shared import framing
from crucible.shared.procs import pid_alive
from crucible.shared.workers import PoolFull, WorkerFailed, WorkerPool, WorkerTimeout

# Says "ready <pid>", then answers each request with "<pid>:<request>"; "die" and "hang" do as they say.
WORKER = """
import os, time
from crucible.shared import framing
framing.write(1, b"ready %d" % os.getpid())
while (request := framing.read(0)) is not None:
    if request == b"die":
        os._exit(1)
    if request == b"hang":
        time.sleep(60)
    framing.write(1, b"%d:%s" % (os.getpid(), request))
"""


async def spawn(index: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)


def pool(size: int = 1, **kw) -> WorkerPool:
    return WorkerPool("test worker", size, spawn, ready=lambda hello: hello.startswith(b"ready "), stop_grace_s=1, **kw)


async def answer(workers: WorkerPool, request: bytes, timeout: float = 30) -> tuple[int, bytes]:
    pid, _, echoed = (await workers.ask(request, timeout=timeout)).partition(b":")
    return int(pid), echoed


async def gone(pid: int) -> bool:
    for _ in range(100):
        if not pid_alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_worker_that_dies_is_replaced_and_the_pool_keeps_serving():
    async with asyncio.timeout(60):
        workers = await pool().start()
        try:
            first, echoed = await answer(workers, b"hello")
            assert echoed == b"hello"
            with pytest.raises(WorkerFailed, match="closed its output"):
                await workers.ask(b"die")
            second, echoed = await answer(workers, b"again")  # waits for the replacement
            assert echoed == b"again" and second != first and workers.restarts == 1
            assert await gone(first)
        finally:
            await workers.close()


async def test_a_worker_that_does_not_answer_in_time_is_killed_and_replaced():
    async with asyncio.timeout(60):
        workers = await pool().start()
        try:
            first, _ = await answer(workers, b"hello")
            with pytest.raises(WorkerTimeout):
                await workers.ask(b"hang", timeout=0.5)
            second, echoed = await answer(workers, b"next")
            assert echoed == b"next" and second != first
            assert await gone(first)
        finally:
            await workers.close()


async def test_a_request_cancelled_mid_way_does_not_answer_the_next_caller():
    async with asyncio.timeout(60):
        workers = await pool().start()
        try:
            first, _ = await answer(workers, b"hello")
            abandoned = asyncio.create_task(workers.ask(b"hang"))
            await asyncio.sleep(0.3)
            abandoned.cancel()
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            second, echoed = await answer(workers, b"mine")
            assert echoed == b"mine" and second != first
        finally:
            await workers.close()


async def test_a_request_over_the_frame_limit_is_refused_and_the_worker_kept():
    async with asyncio.timeout(60):
        workers = await pool(frame_limit=1024).start()
        try:
            first, _ = await answer(workers, b"x")
            with pytest.raises(framing.FrameTooLarge):
                await workers.ask(b"y" * 2048)
            second, echoed = await answer(workers, b"z")  # nothing was sent: the same process answers
            assert (second, echoed, workers.restarts) == (first, b"z", 0)
        finally:
            await workers.close()


async def test_an_error_raised_while_holding_a_worker_replaces_it():
    async with asyncio.timeout(60):
        workers = await pool().start()
        try:
            with pytest.raises(ValueError):
                async with workers.worker() as worker:
                    first = int((await worker.ask(b"x")).partition(b":")[0])
                    raise ValueError("the reply said the job failed")
            second, _ = await answer(workers, b"y")
            assert second != first and workers.restarts == 1
        finally:
            await workers.close()


async def test_requests_spread_over_workers_and_a_full_pool_refuses_at_once():
    async with asyncio.timeout(60):
        workers = await pool(size=2, max_waiting=4).start()
        try:
            # Two taken at once, four waiting: within the bound, all are answered.
            replies = await asyncio.gather(*(answer(workers, b"%d" % i) for i in range(6)))
            assert [echoed for _, echoed in replies] == [b"%d" % i for i in range(6)]
            assert len({pid for pid, _ in replies}) == 2
            async with workers.worker(), workers.worker():
                waiting = [asyncio.create_task(answer(workers, b"queued")) for _ in range(4)]
                await asyncio.sleep(0.1)
                assert not workers.has_capacity()
                with pytest.raises(PoolFull):
                    await workers.ask(b"one too many")
            assert [echoed for _, echoed in await asyncio.gather(*waiting)] == [b"queued"] * 4
            assert workers.has_capacity() and workers.restarts == 0
        finally:
            await workers.close()


async def test_close_stops_every_worker_and_fails_waiters():
    async with asyncio.timeout(60):
        workers = await pool(size=2).start()
        pids = [int((await worker.ask(b"pid")).partition(b":")[0]) for worker in workers._workers]
        async with workers.worker(), workers.worker():
            waiting = asyncio.create_task(workers.ask(b"never"))
            await asyncio.sleep(0.1)
            await workers.close()
        with pytest.raises(RuntimeError, match="closed"):
            await waiting
        assert all([await gone(pid) for pid in pids])


async def test_a_worker_that_does_not_say_ready_fails_the_start():
    workers = WorkerPool("test worker", 2, spawn, ready=lambda hello: hello == b"something else")
    with pytest.raises(WorkerFailed, match="did not start"):
        await workers.start()
    assert all(w.process is None for w in workers._workers)


# Keyed replies: each request is "<key>:<what>", each reply "<key>:<pid>:<what>". A "slow" request is
# answered only after the request that follows it, so replies come out of order; "die" exits.
KEYED_WORKER = """
import os
from crucible.shared import framing
framing.write(1, b"ready %d" % os.getpid())
held = None
while (request := framing.read(0)) is not None:
    key, _, what = request.partition(b":")
    if what == b"die":
        os._exit(1)
    if what == b"slow" and held is None:
        held = request
        continue
    framing.write(1, b"%s:%d:%s" % (key, os.getpid(), what))
    if held is not None:
        k, _, w = held.partition(b":")
        framing.write(1, b"%s:%d:%s" % (k, os.getpid(), w))
        held = None
"""


async def spawn_keyed(index: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-c", KEYED_WORKER, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)


def keyed_pool(size: int = 1) -> WorkerPool:
    return WorkerPool("keyed worker", size, spawn_keyed, ready=lambda hello: hello.startswith(b"ready "),
                      stop_grace_s=1, depth=2, key_of=lambda reply: reply.partition(b":")[0])


async def keyed(workers: WorkerPool, key: bytes, what: bytes) -> tuple[int, bytes]:
    reply = await workers.ask(key + b":" + what, key=key, timeout=30)
    got, pid, echoed = reply.split(b":")
    assert got == key
    return int(pid), echoed


async def test_a_request_goes_to_a_worker_holding_none_before_one_holding_a_request():
    async with asyncio.timeout(60):
        workers = await keyed_pool(2).start()
        try:
            held = asyncio.ensure_future(keyed(workers, b"1", b"slow"))  # its worker holds it: busy
            await asyncio.sleep(0.1)
            other, _ = await keyed(workers, b"2", b"fast")
            assert not held.done()  # the second request went to the idle worker, not to the busy one's second place
            # One place left on each worker now: the next two requests take one each (the busy worker's
            # answer releases the held request).
            (a, _), (b, _) = await asyncio.gather(keyed(workers, b"3", b"x"), keyed(workers, b"4", b"y"))
            first, _ = await held
            assert {a, b} == {first, other} and first != other and workers.restarts == 0
        finally:
            await workers.close()


async def test_a_worker_taking_two_requests_answers_each_its_own_in_any_order():
    async with asyncio.timeout(60):
        workers = await keyed_pool().start()
        try:
            slow = asyncio.ensure_future(keyed(workers, b"1", b"slow"))
            await asyncio.sleep(0.1)
            assert not slow.done()  # held by the worker until the next request is answered
            fast = await keyed(workers, b"2", b"fast")
            assert fast[1] == b"fast" and (await slow)[1] == b"slow" and fast[0] == (await slow)[0]
            assert workers.restarts == 0
            with pytest.raises(ValueError):
                WorkerPool("w", 1, spawn_keyed, ready=bool, depth=2)  # more than one needs key_of
        finally:
            await workers.close()


async def test_a_keyed_worker_that_dies_fails_every_request_it_held_and_is_replaced_once():
    async with asyncio.timeout(60):
        workers = await keyed_pool().start()
        try:
            first, _ = await keyed(workers, b"0", b"hello")
            slow = asyncio.ensure_future(keyed(workers, b"1", b"slow"))
            await asyncio.sleep(0.1)
            with pytest.raises(WorkerFailed):
                await keyed(workers, b"2", b"die")
            with pytest.raises(WorkerFailed):
                await slow
            second, echoed = await keyed(workers, b"3", b"again")
            assert echoed == b"again" and second != first and workers.restarts == 1
            assert await gone(first)
        finally:
            await workers.close()


async def test_a_cancelled_keyed_request_holds_its_place_until_the_worker_has_answered_it():
    """A cancelled request leaves a keyed worker whole (its reply, when it comes, is dropped), and the
    worker never runs a third request because a caller gave up on one: the place of a cancelled
    request comes back when its reply does."""
    async with asyncio.timeout(60):
        workers = await keyed_pool().start()
        try:
            slow = asyncio.ensure_future(keyed(workers, b"1", b"slow"))
            await asyncio.sleep(0.1)
            slow.cancel()
            await asyncio.sleep(0.1)
            assert workers._idle.qsize() == 1  # one place still in use (the worker runs it), one free
            (pid, echoed), (again, more) = await keyed(workers, b"2", b"next"), await keyed(workers, b"3", b"more")
            assert (echoed, more) == (b"next", b"more") and pid == again
            await asyncio.sleep(0.1)
            assert workers._idle.qsize() == 2 and workers.restarts == 0  # both places back, 1's reply dropped
            for i in range(4, 8):
                assert await keyed(workers, b"%d" % i, b"more") == (pid, b"more")
        finally:
            await workers.close()
