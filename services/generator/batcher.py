"""Batches sampling requests across tasks, swaps weights between batches, and bounds policy lag."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from crucible.ml.policy.backends.base import Completion, PolicyBackend
from crucible.ml.policy.sampling import SamplingParams
from crucible.shared import metrics

SAMPLES = metrics.counter("crucible.generator.samples", "completions (and episode turns) sampled", "{sample}")
TOKENS = metrics.counter("crucible.generator.tokens", "tokens sampled", "{token}")
BATCH_MS = metrics.histogram("crucible.generator.batch.duration", "time of one sampling batch", "ms")

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: str | list[int]  # text, or an episode's token ids
    n: int
    params: SamplingParams
    future: asyncio.Future
    counts_for_lag: bool


@dataclass
class LagBound:
    """Lets the generator run at most `max_lag` learner steps ahead of the newest policy version.

    A learner step consumes at most `groups_per_step` groups (RunConfig.groups_a_step_may_take: more
    than the configured groups_per_step with dynamic sampling); once the groups admitted under the
    current version could feed more than max_lag + 1 steps, `admit` waits for a new version.
    Interactive (gRPC) requests are not counted and never wait.
    """

    max_lag: int
    groups_per_step: int
    groups_at_version: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0

    @property
    def budget(self) -> int | None:
        return None if self.max_lag < 0 else (self.max_lag + 1) * self.groups_per_step

    def exhausted(self) -> bool:
        return self.budget is not None and self.groups_at_version >= self.budget

    async def admit(self) -> None:
        """Waits until one more group may be sampled under the current policy, and counts it."""
        while self.exhausted():
            self.waiting += 1
            try:
                await self.changed.wait()
            finally:
                self.waiting -= 1
        self.groups_at_version += 1

    def new_version(self) -> None:
        self.groups_at_version = 0
        self.changed.set()
        self.changed = asyncio.Event()


_SWAP = object()  # queued to wake the batch loop when new weights are offered


@dataclass(eq=False)
class _Offer:
    """A newer policy version offered to the batcher; loaded before a batch once `ready`."""

    version: int
    uri: str  # once ready: what the backend loads (the verified local folder)
    prepare: Callable[[], Awaitable[str]] | None = None
    ready: bool = False

    def __repr__(self) -> str:
        return f"version {self.version} from {self.uri}"


class Batcher:
    def __init__(self, backend: PolicyBackend, *, max_tasks: int, wait_ms: float, lag: LagBound):
        self.backend = backend
        self.max_tasks = max_tasks
        self.wait_s = wait_ms / 1000
        self.lag = lag
        self._queue: asyncio.Queue = asyncio.Queue()
        # Offered versions newer than the one loaded, newest first: the newest ready one is loaded before
        # the next batch; older ones are kept only while a newer one is still being checked (a fallback).
        self._offers: list[_Offer] = []
        self._preparing: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.tokens = 0

    @property
    def waiting_for_policy(self) -> bool:
        return self.lag.waiting > 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._preparing:
            self._preparing.cancel()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def sample(self, prompt: str | list[int], n: int, params: SamplingParams, *, counts_for_lag: bool = True,
                     min_version: int = 0) -> tuple[list[Completion], int, float]:
        """n completions of one prompt, the policy version that produced them, and the batch's ms.

        `min_version`: the version the request asks for at least (a task's min_policy_version); it waits
        for that version to be loaded, at most MIN_VERSION_WAIT_S (a version this generator refuses or
        never hears of must not stop it: the request is then sampled with what it holds)."""
        if min_version > self.backend.version:
            await self._version_at_least(min_version)
        if counts_for_lag:
            await self.lag.admit()
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(prompt, n, params, future, counts_for_lag))
        return await future

    MIN_VERSION_WAIT_S = 30.0

    async def _version_at_least(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.MIN_VERSION_WAIT_S
        while self.backend.version < version:
            left = deadline - loop.time()
            if left <= 0:
                log.warning("asked for policy version %d or newer, still at version %d after %.0f s: sampling "
                            "with it", version, self.backend.version, self.MIN_VERSION_WAIT_S)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.lag.changed.wait(), left)

    MAX_OFFERS = 4  # versions kept in reserve while newer ones are checked (a replayed topic offers many)

    @property
    def newest_version(self) -> int:
        """The version loaded, or the newest one checked and waiting for the next batch boundary."""
        return max([self.backend.version] + [o.version for o in self._offers if o.ready])

    def offer_weights(self, version: int, uri: str, prepare: Callable[[], Awaitable[str]] | None = None) -> bool:
        """Records a newer policy; it is loaded before the next batch (never in the middle of one).

        `prepare()` (fetch the checkpoint and check its hash; returns the local folder to load, raises
        to refuse it) runs beside sampling, never inside the batch loop, one offer at a time, newest
        first: offers that arrive while one is checked wait, and only the newest of them is checked
        next, while an older one is kept as a fallback in case the newer one is refused. Without
        `prepare`, `uri` is loaded as it is. Returns False, changing nothing, for a version not newer
        than the one loaded or one already checked and pending, or one offered before.
        """
        if version <= self.newest_version or any(o.version == version for o in self._offers):
            return False
        offers = sorted([*self._offers, _Offer(version, uri, prepare, ready=prepare is None)],
                        key=lambda o: o.version, reverse=True)
        unchecked = [o for o in offers if not o.ready][: self.MAX_OFFERS]
        self._offers = [o for o in offers if o.ready or o in unchecked]
        if prepare is None:
            self._queue.put_nowait(_SWAP)
        elif self._preparing is None or self._preparing.done():
            self._preparing = asyncio.create_task(self._prepare_offers())
        return True

    async def settle(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) until the offers made so far are checked; the newest is then
        loaded before the next batch."""
        if self._preparing is not None and not self._preparing.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._preparing), timeout_s)
            except asyncio.TimeoutError:
                log.warning("policy versions still being checked after %.0f s: sampling starts anyway", timeout_s)

    async def _prepare_offers(self) -> None:
        """Checks the newest unchecked offer that is newer than every checked one, until none is left."""
        while True:
            newest_ready = self.newest_version
            offer = next((o for o in self._offers if not o.ready and o.version > newest_ready), None)
            if offer is None:
                return
            try:
                local = await offer.prepare()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # refused (hash mismatch, unreadable): sampling goes on with what we have
                log.error("refusing policy %r: %s", offer, exc)
                self._offers = [o for o in self._offers if o is not offer]
                continue
            if offer in self._offers:
                offer.uri, offer.ready = local, True
                self._offers = [o for o in self._offers if o.version >= offer.version]  # older: not needed
                self._queue.put_nowait(_SWAP)

    async def _swap_weights_if_any(self) -> None:
        offer = next((o for o in self._offers if o.ready), None)
        if offer is None:
            return
        self._offers = [o for o in self._offers if o.version > offer.version]
        version, uri = offer.version, offer.uri
        started = time.perf_counter()
        try:
            await asyncio.to_thread(self.backend.load_weights, version, uri)
        except Exception as exc:  # a bad checkpoint must not stop sampling with the weights we have
            log.error("could not load policy version %d from %s: %s", version, uri, exc)
            return
        self.lag.new_version()
        log.info("loaded policy version %d from %s in %.0f ms", version, uri, (time.perf_counter() - started) * 1e3)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            await self._swap_weights_if_any()
            if first is _SWAP or first.future.done():  # a caller gone (its deadline passed) is sampled for nobody
                continue
            batch = [first]
            swap_offered = False
            deadline = loop.time() + self.wait_s
            # Up to max_tasks groups of 8, counted in samples: an episode's next turn is one sample.
            while len(batch) < self.max_tasks * 8 and sum(r.n for r in batch) < self.max_tasks * 8:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if item is _SWAP:
                    swap_offered = True
                else:
                    batch.append(item)
            if swap_offered:
                # Loaded before this batch, not dropped: with the lag bound spent, no request came to take
                # the loop round again, and the version stayed unloaded for good (sampling deadlocked).
                await self._swap_weights_if_any()
            # Only requests with the same sampling parameters share a batch; the rest wait their turn.
            same = [r for r in batch if r.params == first.params and not r.future.done()]
            for r in batch:
                if r.params != first.params and not r.future.done():
                    self._queue.put_nowait(r)
            if not same:
                continue
            started = time.perf_counter()
            try:
                groups = await self._sample(same)
            except Exception as exc:  # a failing batch fails its requests, not the generator
                if len(same) == 1:
                    if not same[0].future.done():
                        same[0].future.set_exception(exc)
                    continue
                # One request's prompt (too long for the model, ...) must not fail the others: each
                # is sampled again alone, and only those that fail alone fail.
                log.warning("a batch of %d requests failed (%s: %s); sampling each alone", len(same),
                            type(exc).__name__, exc)
                for r in same:
                    try:
                        [alone] = await self._sample([r])
                    except Exception as own:
                        if not r.future.done():
                            r.future.set_exception(own)
                    else:
                        if not r.future.done():
                            r.future.set_result((alone, self.backend.version, (time.perf_counter() - started) * 1000))
                continue
            ms = (time.perf_counter() - started) * 1000
            self.batches += 1
            labels = {"backend": self.backend.name}
            BATCH_MS.record(ms, labels)
            SAMPLES.add(sum(len(g) for g in groups), labels)
            TOKENS.add(sum(len(c.token_ids) for g in groups for c in g), labels)
            for r, completions in zip(same, groups):
                self.tokens += sum(len(c.token_ids) for c in completions)
                if not r.future.done():
                    r.future.set_result((completions, self.backend.version, ms))

    async def _sample(self, requests: list[_Request]) -> list[list[Completion]]:
        """One backend call for all requests; requests asking for fewer samples get a prefix."""
        n = max(r.n for r in requests)
        groups = await asyncio.to_thread(self.backend.sample, [r.prompt for r in requests], n, requests[0].params)
        return [g[: r.n] for r, g in zip(requests, groups)]
