"""Scoring processes with a hard time limit per completion.

Every completion is scored in one of `workers` child processes
(`scorer_worker.py`), kept by crucible.shared.workers. One that takes longer
than the limit, or kills its process (a parser recursing into a segfault, sympy
on a 10-million-digit power), is given a `failed` verdict (reward 0,
`scoring_failed`) and its process is replaced; the service itself never runs
model output through a parser, so it never hangs on one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys

from crucible.v1 import verdict_pb2
from crucible.services.verifier import handler
from crucible.services.verifier.scorer_worker import OK, UNVERIFIABLE, decode_reply, encode_reply
from crucible.shared import framing, integrity
from crucible.shared.settings import Settings, get_settings
from crucible.shared.workers import WorkerFailed, WorkerPool, WorkerTimeout

log = logging.getLogger(__name__)

READY = encode_reply(OK, b"ready")  # a scoring process's first frame
GROUP_MAX = 32  # completions sent to one scoring process in one frame by verify_each


class ScoringError(RuntimeError):
    """The scorer raised (a bug, not the completion's fault): retry, then dead-letter."""


async def _spawn(index: int) -> asyncio.subprocess.Process:
    """A scoring process: this interpreter, so it imports the installed `crucible` as the service does."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "crucible.services.verifier.scorer_worker",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)


class ScorerPool:
    def __init__(self, settings: Settings | None = None, workers: int | None = None,
                 timeout_s: float | None = None):
        self.settings = settings or get_settings()
        self.size = workers or self.settings.verifier_workers or os.cpu_count() or 1
        self.timeout_s = timeout_s or self.settings.verifier_score_timeout_s
        # A process that overran its limit is stuck in a parser and never reads its closed stdin:
        # replacing one kills it at once.
        self._workers = WorkerPool("scoring process", self.size, _spawn, ready=lambda hello: hello == READY,
                                   stop_grace_s=0)
        self.failures = 0
        self.secret = integrity.key(self.settings)  # what tasks are signed and results sealed with

    async def start(self) -> "ScorerPool":
        await self._workers.start()
        return self

    async def close(self) -> None:
        await self._workers.close()

    async def __aenter__(self) -> "ScorerPool":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def verify(self, request: verdict_pb2.VerifyRequest) -> verdict_pb2.Verdict:
        """The verdict; Unverifiable for a request that cannot be scored or trusted, ScoringError for a
        scorer bug."""
        [verdict] = await self.verify_group([request])
        return verdict

    async def verify_group(self, requests: list[verdict_pb2.VerifyRequest]) -> list[verdict_pb2.Verdict]:
        """The verdicts of a group's completions, in order, scored together in one round trip to one
        scoring process (a frame each cost a wake-up of a process each, which on a busy machine is a
        scheduling delay each). The time limit holds for the whole group; a group that overruns it or
        kills its process is scored again one completion at a time, so that only the one at fault
        gets a `failed` verdict, after its own limit. Unverifiable or ScoringError as `verify`."""
        for request in requests:
            handler.check_trust(request, self.secret)
        outcomes = await self._score(requests)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        return outcomes

    async def verify_each(self, requests: list[verdict_pb2.VerifyRequest]) -> list[verdict_pb2.Verdict | Exception]:
        """Each request's verdict, or the Unverifiable or ScoringError that says why it has none: for
        unrelated requests answered one by one (the Verifier's batch call), where one that cannot be
        scored never costs the others theirs. The trusted ones travel in up to one group per scoring
        process (of at most GROUP_MAX), scored as verify_group scores a group."""
        outcomes: list = [None] * len(requests)
        trusted = []
        for i, request in enumerate(requests):
            try:
                handler.check_trust(request, self.secret)
            except handler.Unverifiable as exc:
                outcomes[i] = exc
            else:
                trusted.append(i)
        size = min(GROUP_MAX, -(-len(trusted) // self.size)) or 1
        groups = [trusted[k:k + size] for k in range(0, len(trusted), size)]
        scored = await asyncio.gather(*(self._score([requests[i] for i in g]) for g in groups), return_exceptions=True)
        for group, result in zip(groups, scored):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled: not an answer
            for n, i in enumerate(group):
                outcomes[i] = result if isinstance(result, Exception) else result[n]
        return outcomes

    async def _score(self, requests: list[verdict_pb2.VerifyRequest]) -> list[verdict_pb2.Verdict | Exception]:
        """The scoring of requests already found trustworthy: each one's verdict, or the Unverifiable or
        ScoringError its scoring process answered; ScoringError raised for a reply that is broken."""
        if not requests:
            return []
        try:
            reply = await self._workers.ask(framing.join([r.SerializeToString() for r in requests]),
                                            timeout=self.timeout_s)
        except framing.FrameTooLarge as exc:  # nothing was sent: too large together, or this one alone
            if len(requests) > 1:
                half = len(requests) // 2
                return [*await self._score(requests[:half]), *await self._score(requests[half:])]
            self.failures += 1
            return [handler.failed(requests[0], f"the request is larger than a scoring process takes ({exc})")]
        except WorkerFailed as exc:
            if len(requests) > 1:
                log.info("a group of %d completions could not be scored together (%s); scoring each alone",
                         len(requests), exc)
                return [v for alone in await asyncio.gather(*(self._score([r]) for r in requests)) for v in alone]
            self.failures += 1
            why = (f"scoring took longer than {self.timeout_s:g}s" if isinstance(exc, WorkerTimeout)
                   else "the scoring process died on this completion")
            log.warning("rollout %s: %s", requests[0].rollout.id, why)
            return [handler.failed(requests[0], why)]
        try:
            replies = framing.split(reply)
        except (framing.TruncatedFrame, framing.FrameTooLarge) as exc:
            raise ScoringError(f"a scoring process broke its reply: {exc}") from None
        if len(replies) != len(requests):
            raise ScoringError(f"a scoring process answered {len(replies)} of {len(requests)} requests"
                               + (f": {decode_reply(replies[0])[1][:300]!r}" if replies else ""))
        return [_outcome(*decode_reply(r)) for r in replies]


def _outcome(status: int, payload: bytes) -> verdict_pb2.Verdict | Exception:
    if status == OK:
        return verdict_pb2.Verdict.FromString(payload)
    if status == UNVERIFIABLE:
        return handler.Unverifiable(payload.decode("utf-8", "replace"))
    return ScoringError(payload.decode("utf-8", "replace"))
