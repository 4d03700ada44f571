"""Episodes live on the log: kill -9 of the generator, the sandbox-executor or the verifier in the middle
of episodes, restart it, and every episode completes exactly once (real Kafka, services as processes).

Each hop that cannot be repeated identically (sampling a turn, running a tool, scoring) publishes
its output and commits what it consumed in one Kafka transaction; a replica killed in the middle
leaves an open transaction that its restart fences and aborts, and readers (read_committed) never
see the half-done work. The test checks every hop: each turn is published to crucible.actions
once, each episode reaches crucible.episodes once, and each comes out of the aggregator once.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter

import pytest

from crucible.cli.recipe import Recipe
from crucible.cli.train import Run, SERVICES
from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.ml.envs.lookup import Lookup
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.policy.sft import warm_start
from crucible.shared import bus, integrity

from tests.bus_helpers import read_all

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.store, pytest.mark.sandbox]

GROUP = 4
WAVE = 4  # tasks before the kill, and as many more while the service is down


@pytest.fixture(scope="module")
def lookup_policy(tmp_path_factory):
    """The built-in policy warm-started on lookup's call format: it calls the tool about half the time."""
    env = envs.get("lookup")
    assert isinstance(env, Lookup)
    model = fresh_policy(0)
    warm_start(model, env.format_examples(500, seed=0), steps=80, batch_size=32, lr=3e-3)
    return save_checkpoint(model, tmp_path_factory.mktemp("policy") / "init", {"version": 0})




@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", ["generator", "sandbox_executor", "verifier"])
async def test_an_episode_interrupted_by_kill_9_completes_once(victim, stack_settings, tmp_path, lookup_policy):
    settings = stack_settings.model_copy(update={"home": tmp_path})
    recipe = Recipe.model_validate({"algorithm": {"groups_per_step": WAVE, "max_policy_lag": -1,
                                                  "group_timeout_s": 300},
                                    "sampling": {"group_size": GROUP, "max_tokens": 12}})
    run = Run(settings, recipe)
    s = run.settings
    await bus.ensure_topics(["tasks", "rollouts", "executions", "verdicts", "trajectories", "policy", "alerts",
                             "actions", "observations", "episodes"], settings=s)
    names = tuple(n for n in SERVICES if n not in ("learner", "evaluator"))  # no policy steps: nothing changes
    run.start_services(lookup_policy.as_uri(), names)
    tasks = envs.get("lookup").generate("train", seed=7, group_size=GROUP)
    try:
        async with bus.Producer(s) as producer:
            for _ in range(WAVE):
                task = next(tasks)
                await producer.send_and_wait("tasks", task, key=task.id)
            # Wait until episodes are under way (a turn waits for its tool), then kill the victim.
            for _ in range(240):
                run.check_services()
                if await read_all(s, "actions"):
                    break
                await asyncio.sleep(0.25)
            else:
                pytest.fail("no episode reached a tool call")
            os.kill(run.processes[victim].pid, signal.SIGKILL)
            run.processes[victim].wait()
            for _ in range(WAVE):  # more work arrives while it is down
                task = next(tasks)
                await producer.send_and_wait("tasks", task, key=task.id)
            await asyncio.sleep(1.0)
            run.start_service(victim)
        expected = 2 * WAVE * GROUP
        for _ in range(600):
            run.check_services()
            done = await read_all(s, "trajectories")
            if len(done) >= expected:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)  # anything doubled would arrive now
        trajectories = await read_all(s, "trajectories")
        episodes = await read_all(s, "episodes")
        actions = await read_all(s, "actions")
    finally:
        run.stop_services()

    ids = Counter(t.id for t in trajectories)
    assert len(ids) == expected, f"{len(ids)} of {expected} episodes came out"
    assert max(ids.values()) == 1, [i for i, n in ids.items() if n > 1]
    assert all(t.group_complete for t in trajectories)
    finished = Counter(e.id for e in episodes)
    assert len(finished) == expected and max(finished.values()) == 1
    turns = Counter((a.id, len(a.turns)) for a in actions)
    assert max(turns.values()) == 1, "a turn was published twice"
    by_id = {e.id: e for e in episodes}
    for t in trajectories:
        e = by_id[t.id]
        assert t.turns == len(e.turns)
        # the sample is the episode as sampled: its tokens, the observations between them, the loss mask
        assert len(t.loss_mask) == len(t.completion_token_ids) == len(t.logprobs)
        assert sum(t.loss_mask) == sum(len(turn.token_ids) for turn in e.turns)
        for turn in e.turns[:-1]:
            assert turn.observation and turn.observation_token_ids  # every call before the end was answered
    assert any(len(e.turns) >= 2 for e in episodes)


@pytest.mark.timeout(300)
async def test_tool_calls_are_carried_out_once_when_the_executor_dies_in_the_middle_of_a_batch(stack_settings,
                                                                                               tmp_path):
    """A slow call first, quick ones after it, all in one fetch: when the executor is killed while the
    slow one runs, the quick ones are done. At least once, their observations would be published
    twice (once now, once after the restart); in a transaction they are published once."""
    settings = stack_settings.model_copy(update={"home": tmp_path})
    run = Run(settings, Recipe.model_validate({"algorithm": {"max_policy_lag": -1}}))
    s = run.settings
    await bus.ensure_topics(["actions", "observations", "episodes", "rollouts", "executions"], settings=s)
    run.start_services("", ())
    run.services.env["CRUCIBLE_SANDBOX_WORKERS"] = "2"
    run.start_service("sandbox_executor")
    env = envs.get("python")
    task = integrity.sign_task(next(env.generate("train", seed=3, group_size=8)), integrity.key(s))  # as submitted
    codes = ["import time\ntime.sleep(6)\nprint('slow')"] + [f"print({i} * 11)" for i in range(1, 8)]
    try:
        await asyncio.sleep(8)  # the executor joins its groups
        async with bus.Producer(s) as producer:
            for index, code in enumerate(codes):
                episode = ep.start(task, "faults", index, [1, 2], temperature=1.0, top_p=1.0, call_format="plain")
                ep.add_turn(episode, "@python " + json.dumps({"code": code}), [3], [-0.5], "stop", 0)
                await producer.send("actions", episode, key=episode.group_id)
            await producer.flush()
        await asyncio.sleep(3.0)  # the quick calls are done, the slow one is still running
        os.kill(run.processes["sandbox_executor"].pid, signal.SIGKILL)
        run.processes["sandbox_executor"].wait()
        run.start_service("sandbox_executor")
        for _ in range(120):
            run.check_services()
            observed = await read_all(s, "observations")
            if len({o.id for o in observed}) >= len(codes):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)
        observed = await read_all(s, "observations")
    finally:
        run.stop_services()
    counts = Counter(o.id for o in observed)
    assert len(counts) == len(codes) and max(counts.values()) == 1, counts
    for o in observed:
        expected = "slow" if o.index == 0 else str(o.index * 11)
        assert o.turns[-1].observation.strip() == expected
