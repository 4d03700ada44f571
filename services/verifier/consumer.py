"""The Kafka side: crucible.executions and answer-only crucible.rollouts -> crucible.verdicts."""
from __future__ import annotations

from crucible.services.verifier import handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.shared import bus

TOPICS = ["executions", "rollouts"]


def verdict_handler(scorer: ScorerPool):
    """A bus handler: one verdict per execution or answer-only rollout; bad ones go to the DLQ with the reason."""

    async def handle(incoming: bus.Incoming):
        try:
            request = handler.request_for(incoming.message)
            if request is None:
                return []  # needs the sandbox first: it comes back on crucible.executions
            verdict = await scorer.verify(request)
        except handler.Unverifiable as exc:
            raise bus.Reject(str(exc)) from exc
        return [bus.Outgoing("verdicts", verdict, key=request.rollout.group_id or request.rollout.id)]

    return handle
