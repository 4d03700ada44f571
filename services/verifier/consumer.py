"""The Kafka side: crucible.executions, answer-only crucible.rollouts and finished crucible.episodes ->
crucible.verdicts (a group's verdicts in one record; an episode, one sample, in one of its own)."""
from __future__ import annotations

import asyncio
from collections import Counter

from crucible.services.verifier import handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.shared import bus, integrity, metrics

from crucible.v1 import episode_pb2, verdict_pb2

TOPICS = ["executions", "rollouts", "episodes"]
VERDICTS = metrics.counter("crucible.verifier.verdicts", "verdicts given, by task kind and whether solved", "{verdict}")
COMPONENTS = metrics.histogram("crucible.verifier.reward_component",
                               "each group's mean of each reward component, by kind (every sample's value is in the "
                               "store's trajectories.reward_components)")


def observe(verdicts) -> None:
    """A group's verdicts counted once per label set (a group's are mostly alike), and its mean of each
    component recorded once: a histogram takes its values one call each (about 12 us here), and every
    sample's were a fifth of the verifier's CPU (32 groups of 8 samples and 4 components a step)."""
    for (kind, passed, tampered), count in Counter((v.task_kind, v.sample.passed, v.tampered) for v in verdicts).items():
        VERDICTS.add(count, {"kind": kind, "passed": str(passed).lower(), "tampered": str(tampered).lower()})
    sums: dict[tuple[str, str], list[float]] = {}  # (kind, component) -> [sum, count]
    for v in verdicts:
        for name, value in v.components.items():
            total = sums.setdefault((v.task_kind, name), [0.0, 0])
            total[0] += value
            total[1] += 1
    for (kind, name), (total, count) in sums.items():
        COMPONENTS.record(total / count, {"kind": kind, "component": name})


def verdict_handler(scorer: ScorerPool):
    """A bus handler: a group's verdicts, one per sample, in one record; a group that cannot be verified
    goes to the DLQ."""

    async def handle(incoming: bus.Incoming):
        if isinstance(incoming.message, episode_pb2.Episode):
            episode = incoming.message
            try:  # its turns a generator's and its observations a sandbox's, its task a trusted submitter's
                integrity.check_sampled(episode, scorer.secret)
            except integrity.IntegrityError as exc:
                raise bus.Reject(f"episode {episode.id!r}: {exc}") from exc
            try:
                verdict = await asyncio.to_thread(handler.verify_episode, episode)
            except handler.Unverifiable as exc:
                raise bus.Reject(str(exc)) from exc
            observe([verdict])
            return [bus.Outgoing("verdicts", verdict_pb2.VerdictGroup(verdicts=[verdict]), key=episode.group_id)]
        try:
            # Signatures first: what no trusted service wrote costs an HMAC, never the task's checks (a
            # compile and walks of its tests). A group to be run first is the sandbox's to refuse, once.
            if handler.scored_here(incoming.message):
                integrity.check_sampled(handler.group_of(incoming.message), scorer.secret)
            requests = handler.requests_for(incoming.message)
            verdicts = await scorer.verify_group(requests)
        except integrity.IntegrityError as exc:
            raise bus.Reject(str(exc)) from exc
        except handler.Unverifiable as exc:
            raise bus.Reject(str(exc)) from exc
        if not verdicts:
            return []  # a group to be run first: its verdicts come from its execution
        group = handler.group_of(incoming.message)
        observe(verdicts)
        # One record, not one a sample: what the aggregator and the broker pay per record (a step's 256
        # verdicts were 256 records; faust spent about 40% of the aggregator's busy time per record).
        return [bus.Outgoing("verdicts", verdict_pb2.VerdictGroup(verdicts=[handler.in_group(v, group) for v in verdicts]),
                             key=group.group_id)]

    return handle
