"""The Kafka side: crucible.executions, answer-only crucible.rollouts and finished crucible.episodes ->
crucible.verdicts (one per sample; an episode is one sample)."""
from __future__ import annotations

import asyncio

from crucible.services.verifier import handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.shared import bus, integrity, metrics

from crucible.v1 import episode_pb2

TOPICS = ["executions", "rollouts", "episodes"]
VERDICTS = metrics.counter("crucible.verifier.verdicts", "verdicts given, by task kind and whether solved", "{verdict}")
COMPONENTS = metrics.histogram("crucible.verifier.reward_component", "each reward component's value, by kind")


def observe(verdicts) -> None:
    for v in verdicts:
        VERDICTS.add(1, {"kind": v.task_kind, "passed": str(v.sample.passed).lower(),
                         "tampered": str(v.tampered).lower()})
        for name, value in v.components.items():
            COMPONENTS.record(value, {"kind": v.task_kind, "component": name})


def verdict_handler(scorer: ScorerPool):
    """A bus handler: one verdict per sample of a group; a group that cannot be verified goes to the DLQ."""

    async def handle(incoming: bus.Incoming):
        if isinstance(incoming.message, episode_pb2.Episode):
            episode = incoming.message
            try:
                integrity.check_task(episode.task, scorer.secret)
            except integrity.IntegrityError as exc:
                raise bus.Reject(f"episode {episode.id!r}: {exc}") from exc
            try:
                verdict = await asyncio.to_thread(handler.verify_episode, episode)
            except handler.Unverifiable as exc:
                raise bus.Reject(str(exc)) from exc
            observe([verdict])
            return [bus.Outgoing("verdicts", verdict, key=episode.group_id)]
        try:
            requests = handler.requests_for(incoming.message)
            verdicts = await scorer.verify_group(requests)
        except handler.Unverifiable as exc:
            raise bus.Reject(str(exc)) from exc
        group = handler.group_of(incoming.message)
        observe(verdicts)
        return [bus.Outgoing("verdicts", handler.in_group(v, group), key=group.group_id) for v in verdicts]

    return handle
