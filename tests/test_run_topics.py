"""A finished run's topics are deleted (its results live in the store and its folder); an interrupted
run keeps its own, to be resumed, and nothing else is touched."""
from __future__ import annotations

import json

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from crucible.cli.train import REPORT, RUN_STATE, ResumeError, forget_finished_runs, resumable, run_prefixes
from crucible.shared import bus

pytestmark = pytest.mark.kafka


async def topics(settings) -> set[str]:
    admin = AIOKafkaAdminClient(**bus.connection(settings))
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def test_the_topics_of_finished_runs_go_and_those_of_others_stay(settings):
    tag = settings.topic_prefix.rstrip(".")  # this test's own: run ids nobody else uses
    finished, interrupted = f"train-{tag}-1", f"train-{tag}-2"
    made = {}
    for run_id in (finished, interrupted):
        topic_prefix, group_prefix = run_prefixes(run_id)
        run_settings = settings.model_copy(update={"topic_prefix": topic_prefix, "consumer_group_prefix": group_prefix})
        made[run_id] = await bus.ensure_topics(["tasks", "verdicts"], settings=run_settings)
        made[run_id] += await bus.ensure_topics([f"{group_prefix}reward-aggregator-groups-changelog"],
                                                settings=settings.model_copy(update={"topic_prefix": ""}),
                                                with_dlq=False)
        folder = settings.home / "runs" / run_id
        folder.mkdir(parents=True)
        (folder / RUN_STATE).write_text(json.dumps({"run_id": run_id}))
    (settings.home / "runs" / finished / REPORT).write_text("{}")
    others = await bus.ensure_topics(["tasks"], settings=settings)  # this deployment's own, no run's
    assert len(made[finished]) == len(made[interrupted]) == 5
    lines = []
    await forget_finished_runs(settings, echo=lines.append)
    left = await topics(settings)
    assert not left & set(made[finished])
    assert set(made[interrupted]) <= left and set(others) <= left
    assert lines == ["      deleted the 5 topics of 1 finished run(s) (their results are in the store and under runs/)"]
    await forget_finished_runs(settings, echo=lines.append)  # nothing more to delete: nothing said
    assert len(lines) == 1
    with pytest.raises(ResumeError, match="has finished"):
        resumable(settings, finished)
    with pytest.raises(ValueError, match="each must name something"):
        await bus.delete_topics(["crucible.", ""], settings=settings)


async def test_a_broker_that_cannot_be_reached_leaves_a_finished_run_finished(settings):
    from crucible.shared.procs import free_port

    gone = settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    (gone.home / "runs" / "train-x-1").mkdir(parents=True)
    (gone.home / "runs" / "train-x-1" / REPORT).write_text("{}")
    lines = []
    await forget_finished_runs(gone, echo=lines.append)
    assert len(lines) == 1 and "could not delete finished runs' topics" in lines[0] and "the next run will" in lines[0]
