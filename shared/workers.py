"""A pool of worker processes that answer framed requests; a worker that fails is replaced.

The sandbox (its jail workers) and the verifier (its scoring processes) both run
work that may crash or hang a process, so they run it in children of the
service. Each child speaks `framing` on its stdin and stdout: its first frame
says it is ready, then it answers every request with one reply frame.

A request takes an idle worker. If anything goes wrong while a caller holds one
(it died, closed its output, did not answer in time, the caller found the reply
to be an error, the caller was cancelled mid-request), the state of that worker's
stream is unknown: a late reply would answer the next caller. So it is stopped
and started afresh in the background, and rejoins the idle workers once it says
it is ready again; the caller gets its error at once, without waiting for the
restart.

Callers that wait for a busy pool are bounded (`max_waiting`): past the bound a
request is refused with PoolFull at once, the pool's backpressure point.

A worker may take `depth` requests at once (the sandbox's workers prepare the next
job's jail while one runs, and take two, so none waits for the round trip of a
result and the next request); a request goes to the least busy worker, so one that
holds nothing takes it before one that holds a request already. Its replies then come in the order its requests
finish: each names its request (`key_of(reply)`, the key the caller gave with it),
and a reader per worker hands each to its caller. A request cancelled there leaves
the stream whole (its late reply is dropped); anything else that goes wrong still
replaces the worker, and fails the other requests it held.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import AsyncIterator, Awaitable, Callable, Hashable

from crucible.shared import framing

log = logging.getLogger(__name__)

Spawn = Callable[[int], Awaitable[asyncio.subprocess.Process]]  # worker index -> its started process
KeyOf = Callable[[bytes], Hashable]  # a reply -> the key of the request it answers


class PoolFull(Exception):
    """Every worker is busy and as many requests as the pool allows are already waiting."""


class WorkerFailed(RuntimeError):
    """A worker died, closed its output or broke the framing (it is being replaced)."""


class WorkerTimeout(WorkerFailed):
    """A worker did not answer in time (it is being replaced)."""


class Worker:
    """One worker process: request frames to its stdin, reply frames from its stdout."""

    def __init__(self, name: str, index: int, spawn: Spawn, ready: Callable[[bytes], bool], frame_limit: int,
                 key_of: KeyOf | None = None):
        self.name, self.index = name, index
        self.process: asyncio.subprocess.Process | None = None
        self._spawn, self._ready, self._limit = spawn, ready, frame_limit
        self.generation = 0  # counts starts: a pool's tokens for an earlier process are stale
        self.restarting = False
        # Keyed replies (several requests at once): each waiting request's future, by its key.
        self._key_of = key_of
        self._pending: dict[Hashable, asyncio.Future] = {}
        self._abandoned: set[Hashable] = set()  # cancelled requests whose replies are still to come
        self.on_dropped_reply: Callable[[], None] | None = None  # called as each such reply is dropped
        self._reader: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"{self.name} {self.index}"

    async def start(self) -> None:
        """Starts the process and waits for its first frame, which must pass `ready`."""
        self.process = await self._spawn(self.index)
        hello = await self._receive()
        if not self._ready(hello):
            raise WorkerFailed(f"{self} did not start: {hello[:300]!r}")
        self.generation += 1
        if self._key_of is not None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(self.process.stdout))

    async def ask(self, *frames: bytes, timeout: float | None = None, key: Hashable = None) -> bytes:
        """Sends `frames` (one request; with keyed replies, `key` names it) and returns the reply
        frame; WorkerFailed or WorkerTimeout if none comes."""
        try:
            return await asyncio.wait_for(self._exchange(frames, key), timeout)
        except TimeoutError:
            raise WorkerTimeout(f"{self} did not answer within {timeout:g}s") from None

    async def stop(self, grace_s: float) -> None:
        """Closes its input (a worker leaves when it ends), kills it after `grace_s`, reaps it."""
        process, self.process = self.process, None
        reader, self._reader = self._reader, None  # hands on the replies still coming until the output ends
        try:
            if process is None:
                return
            if process.stdin is not None:
                process.stdin.close()
            try:
                if process.returncode is None and grace_s > 0:
                    await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                pass
            finally:  # also when cancelled while waiting: the process must not outlive its pool
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await process.wait()
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def _exchange(self, frames: tuple[bytes, ...], key: Hashable) -> bytes:
        request = b"".join(framing.encode(frame, self._limit) for frame in frames)
        if self._key_of is None:
            await self._send(request)
            return await self._receive()
        if self._reader is None or self._reader.done():
            raise WorkerFailed(f"{self} is not reading replies (it exited or was stopped)")
        if key is None or key in self._pending:
            raise ValueError(f"a request to {self} needs a key no waiting request has, not {key!r}")
        future = self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            await self._send(request)
            return await future
        except asyncio.CancelledError:
            # (Cancelling the task awaiting the future cancels the future too: done, with no reply.)
            if not future.done() or future.cancelled():  # the worker still runs it: its reply is dropped
                self._abandoned.add(key)                  # when it comes
            elif self.on_dropped_reply is not None:  # answered as it was cancelled: its place is free now
                self.on_dropped_reply()
            raise
        finally:
            self._pending.pop(key, None)

    async def _send(self, request: bytes) -> None:
        try:
            self.process.stdin.write(request)
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerFailed(f"{self} stopped reading its input: {exc!r}") from None

    async def _read_replies(self, stream: asyncio.StreamReader) -> None:
        """Hands each reply to the request it names, until the worker fails; then fails every waiting one."""
        failure: BaseException = WorkerFailed(f"{self} was stopped")
        try:
            while True:
                frame = await self._receive(stream)
                try:
                    key = self._key_of(frame)
                except Exception as exc:
                    raise WorkerFailed(f"{self} sent a reply that names no request: {exc}") from None
                future = self._pending.pop(key, None)
                if key in self._abandoned:
                    self._abandoned.discard(key)
                    if self.on_dropped_reply is not None:
                        self.on_dropped_reply()
                elif future is not None and not future.done():
                    future.set_result(frame)
        except WorkerFailed as exc:
            failure = exc
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(failure)
            self._pending.clear()
            self._abandoned.clear()

    async def _receive(self, stream: asyncio.StreamReader | None = None) -> bytes:
        try:
            frame = await framing.read_stream(stream or self.process.stdout, self._limit)
        except (framing.TruncatedFrame, framing.FrameTooLarge, ConnectionResetError) as exc:
            raise WorkerFailed(f"{self} broke the framing: {exc}") from None
        if frame is None:
            raise WorkerFailed(f"{self} closed its output (it exited or was killed)")
        return frame


class _IdleTokens(asyncio.Queue):
    """The tokens of requests the workers may take now (a worker has `depth` of them): a request takes a
    token of the worker with the most of them here, the least busy one, the longest waiting among
    equals; None (the pool closing) first. A request thus goes to a worker that is doing nothing
    wherever there is one: taken in the order they were put, both tokens of a sandbox worker came
    before another worker's, and two jobs shared one worker (its CPU, where it is pinned to one)
    while the other worker waited."""

    def _init(self, maxsize):
        self._queue = []

    def _put(self, item):
        self._queue.append(item)

    def _get(self):
        tokens = self._queue
        if None in tokens:
            return tokens.pop(tokens.index(None))
        free = Counter(id(worker) for worker, _ in tokens)
        return tokens.pop(max(range(len(tokens)), key=lambda i: (free[id(tokens[i][0])], -i)))


class WorkerPool:
    """`size` workers started by `spawn`; requests go to idle ones (the least busy first, where a
    worker takes more than one at once), failed ones are replaced."""

    def __init__(self, name: str, size: int, spawn: Spawn, *, ready: Callable[[bytes], bool],
                 max_waiting: int | None = None, stop_grace_s: float = 5.0,
                 frame_limit: int = framing.DEFAULT_LIMIT, depth: int = 1, key_of: KeyOf | None = None):
        if depth < 1 or (depth > 1 and key_of is None):
            raise ValueError("a worker takes at least one request; more than one only with keyed replies (key_of)")
        self.name = name  # "sandbox worker": used in logs and errors
        self.size = size
        self.depth = depth  # requests a worker takes at once
        self._key_of = key_of
        self.max_waiting = max_waiting
        self.stop_grace_s = stop_grace_s  # how long a worker whose input closed may take to leave
        self.restarts = 0
        self._spawn, self._ready, self._frame_limit = spawn, ready, frame_limit
        self._workers: list[Worker] = []
        # One token per request a worker may take: (worker, its generation); None once the pool closes.
        self._idle: asyncio.Queue[tuple[Worker, int] | None] = _IdleTokens()
        self._waiting = 0
        self._restarting: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> "WorkerPool":
        self._workers = [Worker(self.name, i, self._spawn, self._ready, self._frame_limit, self._key_of)
                         for i in range(self.size)]
        for worker in self._workers:  # a cancelled request's place is free once the worker has answered it
            worker.on_dropped_reply = lambda w=worker: self._idle.put_nowait((w, w.generation))
        outcomes = await asyncio.gather(*(w.start() for w in self._workers), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            await asyncio.gather(*(w.stop(0) for w in self._workers), return_exceptions=True)
            raise failed[0]
        for worker in self._workers:
            self._add_tokens(worker)
        return self

    async def close(self) -> None:
        """Stops every worker; requests still waiting for one fail."""
        self._closed = True
        for task in self._restarting:
            task.cancel()
        await asyncio.gather(*self._restarting, return_exceptions=True)
        await asyncio.gather(*(w.stop(self.stop_grace_s) for w in self._workers), return_exceptions=True)
        self._idle.put_nowait(None)

    def has_capacity(self) -> bool:
        """Whether a request now would be taken (by an idle worker, or to wait within the bound)."""
        return self._idle.qsize() > 0 or self.max_waiting is None or self._waiting < self.max_waiting

    @contextlib.asynccontextmanager
    async def worker(self) -> AsyncIterator[Worker]:
        """An idle worker for one request (the block makes one `ask`); if the block raises (anything,
        cancellation included), the worker is replaced rather than handed to the next caller, except
        that a keyed worker's cancelled request only gives its place back once answered."""
        if self._closed:
            raise RuntimeError(f"the {self.name} pool is closed")
        if not self.has_capacity():
            raise PoolFull(f"all {self.size} {self.name}s are busy and {self._waiting} requests are waiting")
        self._waiting += 1
        try:
            while True:
                token = await self._idle.get()
                if token is None or self._closed:  # close() put None in for the waiters; each passes it on
                    self._idle.put_nowait(None)
                    raise RuntimeError(f"the {self.name} pool was closed")
                worker, generation = token
                if generation == worker.generation and not worker.restarting:
                    break  # else a token of a process since replaced: its restart added fresh ones
        finally:
            self._waiting -= 1
        try:
            yield worker
        except framing.FrameTooLarge:  # a request refused before any of it was sent (replies: WorkerFailed)
            self._idle.put_nowait(token)  # the worker is as it was: not restarted for the caller's size
            raise
        except asyncio.CancelledError as exc:
            # Keyed: the stream is whole; the request's place comes back when its reply has been dropped
            # (Worker.on_dropped_reply), so a worker never runs more than `depth` requests at once.
            if self.depth == 1:
                self._replace(worker, exc)
            raise
        except BaseException as exc:
            self._replace(worker, exc)
            raise
        self._idle.put_nowait(token)

    async def ask(self, *frames: bytes, timeout: float | None = None, key: Hashable = None) -> bytes:
        """One request to an idle worker: its reply frame (see Worker.ask)."""
        async with self.worker() as worker:
            return await worker.ask(*frames, timeout=timeout, key=key)

    def _add_tokens(self, worker: Worker) -> None:
        for _ in range(self.depth):
            self._idle.put_nowait((worker, worker.generation))

    def _replace(self, worker: Worker, why: BaseException) -> None:
        if self._closed or worker.restarting:
            return  # close() stops every worker; a restart under way serves every request that failed with it
        worker.restarting = True
        self.restarts += 1
        reason = "the request was cancelled" if isinstance(why, asyncio.CancelledError) else (
            str(why) or type(why).__name__)
        log.warning("%s: %s; restarting it", worker, reason)
        task = asyncio.get_running_loop().create_task(self._restart(worker))
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _restart(self, worker: Worker) -> None:
        await worker.stop(self.stop_grace_s)
        delay = 0.5
        while not self._closed:
            try:
                await worker.start()
            except Exception as exc:
                await worker.stop(0)
                log.error("%s did not restart (%s); trying again in %.1fs", worker, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
                continue
            worker.restarting = False
            self._add_tokens(worker)
            return
