"""The learner over real Kafka and the real store: steps, stale samples, checkpoints and resume."""
from __future__ import annotations

import asyncio
import json

import pytest

from crucible.v1 import policy_pb2, rollout_pb2, task_pb2, trajectory_pb2, verdict_pb2
from crucible.services.learner import checkpoints
from crucible.services.learner.__main__ import run
from crucible.shared import bus, messages, store
from crucible.ml.policy.backends import create_backend
from crucible.ml.policy.checkpoint import load_checkpoint
from crucible.ml.policy.sampling import SamplingParams
from tests.test_bus import read_raw

pytestmark = [pytest.mark.kafka, pytest.mark.store]

SEED = 21


def trajectories_for(group: str, policy_version: int, rewards: list[float]) -> list[trajectory_pb2.Trajectory]:
    """A group sampled from the learner's own initial policy, so its log-probs are real."""
    backend = create_backend("torch", seed=SEED, sample_seed=hash(group) % 1000)
    completions = backend.sample([f"{group}: 2+2="], len(rewards), SamplingParams(max_tokens=6))[0]
    task = task_pb2.Task(id=f"task-{group}", kind="exact", prompt=f"{group}: 2+2=", group_size=len(rewards),
                         answer=task_pb2.ExpectedAnswer(answer="4"))
    mean = sum(rewards) / len(rewards)
    out = []
    for i, (c, r) in enumerate(zip(completions, rewards)):
        rollout = rollout_pb2.Rollout(id=f"{group}/{i}", task=task, group_id=group, sample_index=i,
                                      group_size=len(rewards), policy_version=policy_version, completion=c.text,
                                      prompt_token_ids=c.prompt_token_ids, token_ids=c.token_ids, logprobs=c.logprobs)
        verdict = verdict_pb2.Verdict(id=f"v/{group}/{i}", rollout=rollout, reward=r,
                                      components={"answer_correct": r})
        out.append(trajectory_pb2.Trajectory(id=rollout.id, verdict=verdict, reward=r, advantage=r - mean,
                                             estimator="reinforce", group_complete=True,
                                             group_received=len(rewards)))
    return out


async def publish(settings, trajectories):
    async with bus.Producer(settings) as producer:
        for t in trajectories:
            await producer.send_and_wait("trajectories", t, key=t.verdict.rollout.group_id)


async def policies(settings, n: int) -> list[policy_pb2.PolicyVersion]:
    return [messages.decode(r.value, policy_pb2.PolicyVersion) for r in await read_raw(settings, "policy", n, 60)]


async def test_steps_drop_stale_samples_and_resume_from_checkpoint(stack_settings, tmp_path):
    settings = stack_settings.model_copy(update={
        "learner_groups_per_step": 2, "max_policy_lag": 0, "generator_seed": SEED, "home": tmp_path,
        "run_id": "test-run", "learner_lr": 1e-2})
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        assert (await policies(settings, 1))[0].version == 0  # announced at start
        await publish(settings, trajectories_for("g1", 0, [1, 0, 0, 1]) + trajectories_for("g2", 0, [0, 1, 1, 1]))
        v1 = (await policies(settings, 2))[1]
        assert v1.version == 1 and v1.metrics.samples == 8 and v1.metrics.dropped_stale == 0
        assert v1.metrics.grad_norm > 0 and v1.metrics.pass_rate == pytest.approx(5 / 8)
        # Samples from version 0 are now one version behind: beyond max_policy_lag=0, so dropped and counted.
        await publish(settings, trajectories_for("g3", 0, [1, 0]) + trajectories_for("g4", 1, [1, 0]))
        v2 = (await policies(settings, 3))[2]
        assert v2.version == 2 and v2.metrics.dropped_stale == 2 and v2.metrics.samples == 4
    finally:
        stop.set()
        await asyncio.wait_for(learner, 30)

    folder = checkpoints.latest(settings)
    meta = json.loads((folder / "crucible.json").read_text())
    assert folder.name == "v000002" and meta["version"] == 2 and meta["step"] == 2
    assert meta["offsets"] == {"0": 12}  # every record read so far was used: resume right after them
    assert (folder / "optimizer.pt").exists()
    saved, _ = load_checkpoint(folder)

    # A new learner process resumes at version 2 with the same weights and reads only what is new.
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        announced = (await policies(settings, 4))[3]
        assert announced.version == 2 and announced.checkpoint_uri == folder.as_uri()
        await publish(settings, trajectories_for("g5", 2, [1, 0]) + trajectories_for("g6", 2, [0, 1]))
        v3 = (await policies(settings, 5))[4]
        assert v3.version == 3 and v3.metrics.samples == 4 and v3.metrics.dropped_stale == 0
    finally:
        stop.set()
        final = await asyncio.wait_for(learner, 30)
    assert final.step_count == 3
    assert not all(
        (a == b).all() for a, b in zip(saved.state_dict().values(), final.model.state_dict().values()))
    client = store.connect(settings)
    rows = client.query("SELECT step, policy_version FROM train_steps FINAL WHERE run_id = 'test-run' "
                        "ORDER BY step").result_rows
    assert rows == [(1, 1), (2, 2), (3, 3)]
