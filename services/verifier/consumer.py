"""The Kafka side: crucible.executions and answer-only crucible.rollouts -> crucible.verdicts (one per sample)."""
from __future__ import annotations

import asyncio

from crucible.services.verifier import handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.shared import bus

TOPICS = ["executions", "rollouts"]


def verdict_handler(scorer: ScorerPool):
    """A bus handler: one verdict per sample of a group; a group that cannot be verified goes to the DLQ."""

    async def handle(incoming: bus.Incoming):
        try:
            requests = handler.requests_for(incoming.message)
            verdicts = await asyncio.gather(*(scorer.verify(r) for r in requests))
        except handler.Unverifiable as exc:
            raise bus.Reject(str(exc)) from exc
        group = handler.group_of(incoming.message)
        return [bus.Outgoing("verdicts", handler.in_group(v, group), key=group.group_id) for v in verdicts]

    return handle
