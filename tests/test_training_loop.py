"""Acceptance: the whole loop over real Kafka, all five services as processes, improves a held-out split.

The built-in `digits` family (parity of the last of four digits) is warm-started on the answer
format only (random answers), so the initial policy answers well-formed but at chance on the
held-out split. Policy steps through generator -> verifier -> reward-aggregator -> learner
(32 tasks x 8 samples a step, RLOO advantages, KL 0.2 to the warm-started policy) then teach it the
task. Measured with bench/bench_pipeline.py (sync, 80 steps, at the old init scale 0.02): seed 0
0.500 -> 1.000, seed 1 0.540 -> 1.000, seed 3 0.460 -> 0.880, seed 2 stayed at 0.490 (it learnt
in-process and async, late), about two and a half minutes each. At init scale 0.1 (digits.toml
now) one run of this test: 0.500 -> 0.815 at version 20, 1.000 from version 40, 80 steps in two
minutes. The test takes 80 steps and asks for a margin no lucky initial policy reaches: +0.25 absolute.
"""
from __future__ import annotations

import pytest

from crucible.cli import recipe as recipes
from crucible.cli.train import run_prefixes, train
from crucible.shared import store
from tests.test_run_topics import topics

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.store]


async def test_rl_loop_raises_heldout_pass_rate(stack_settings, tmp_path):
    lines = []
    settings = stack_settings.model_copy(update={"home": tmp_path})
    recipe = recipes.builtin()  # what `crucible train` runs with no recipe: recipes/digits.toml
    recipe.budget.minutes = 8
    report = await train(settings, recipe, echo=lines.append)
    assert report.steps >= 80
    assert 0.3 <= report.heldout_before <= 0.7, "the warm-start taught the format, not the answers"
    assert report.heldout_after >= report.heldout_before + 0.25, (report.heldout_before, report.heldout_after)
    assert any("held-out pass rate after RL" in line for line in lines)
    # The starting policy is scored once, by the evaluator, before the first task is fed: the report's
    # figure is the evaluator's, and no evaluation ran beside the first steps.
    first = report.evaluations[0]
    assert (first["version"], first["heldout"]) == (0, report.heldout_before), report.evaluations
    assert first["t"] <= 0.3, report.evaluations  # seen as the feeding began (it came 1.2-1.4 s in, beside the steps)
    # Where a step's time went, from the run's spans and the learner's own timings.
    breakdown = report.step_breakdown
    assert breakdown["sample_ms"] > 0 and breakdown["learner_step_ms"] > 0 and breakdown["checkpoint_ms"] > 0, breakdown
    assert {"to_verifier_ms", "verify_ms", "to_aggregator_ms", "to_learner_ms", "publish_ms"} <= breakdown.keys()
    # What each process spent per step: the services, the broker and the store all do work every step.
    cpu = report.cpu_ms_per_step
    for name in ("learner", "generator", "verifier", "reward_aggregator", "broker", "store"):
        assert cpu.get(name, 0) > 0, cpu
    # The run left its trace in the store: every step and every sample.
    client = store.connect(settings)
    steps = client.query("SELECT count() FROM train_steps FINAL WHERE run_id = {r:String}",
                         parameters={"r": report.run_id}).result_rows[0][0]
    samples = client.query("SELECT count() FROM trajectories FINAL").result_rows[0][0]
    assert steps >= 80
    assert samples >= 80 * 16 * 8
    # Asynchronous (the recipe's max_policy_lag 1): the generator sampled a step ahead of the learner, and
    # never with a version older than the feeder had seen (min_policy_version), so nothing was too stale.
    rows = client.query("SELECT metrics['policy_lag'], metrics['dropped_stale'] FROM policy_versions FINAL "
                        "WHERE run_id = {r:String} AND version > 1", parameters={"r": report.run_id}).result_rows
    lags = sorted(lag for lag, _ in rows)
    assert lags[len(lags) // 2] == 1.0, lags
    assert sum(stale for _, stale in rows) == 0, rows
    # Nor were the steps fed a version early (each held by the generator until the version it asked
    # for): most of the run's steps were.
    assert report.tasks_fed_early >= 40 * recipe.algorithm.groups_per_step, report.tasks_fed_early


async def test_dynamic_sampling_keeps_the_loop_fed_and_counts_what_it_filtered(stack_settings, tmp_path):
    """With dynamic sampling the learner waits for informative groups; `crucible train` replaces each
    filtered group with another task (FlatGroups), so no step waits on the stall timer."""
    lines = []
    settings = stack_settings.model_copy(update={"home": tmp_path})
    recipe = recipes.builtin()
    recipe.algorithm.dynamic_sampling = True
    recipe.algorithm.max_policy_lag = 1  # what it pairs with: a group finished after its step still serves the next
    recipe.budget.steps, recipe.budget.minutes = 12, 4
    report = await train(settings, recipe, echo=lines.append)
    assert report.steps >= 12
    assert not any("no new policy version" in line for line in lines), lines
    # finished: its topics are gone (its results are in the store)
    assert not [t for t in await topics(settings) if t.startswith(run_prefixes(report.run_id))]
    assert any("deleted the" in line and "topics of 1 finished run" in line for line in lines), lines[-5:]
    client = store.connect(settings)
    rows = client.query("SELECT version, metrics['filtered_groups'] FROM policy_versions FINAL "
                        "WHERE run_id = {r:String} AND version > 0", parameters={"r": report.run_id}).result_rows
    assert len(rows) >= 12 and sum(f for _, f in rows) > 0, rows  # chance-level groups of 8 are sometimes all equal


def test_flat_groups_counts_each_complete_group_with_equal_rewards_or_too_stale_once():
    """What `crucible train` replaces with another task (pure logic): a group counts once all the samples the
    aggregator emitted have arrived (a sample sent twice counts once), when its rewards are all equal or its
    newest sample is more versions old than the lag bound allows."""
    from crucible.cli.train import FlatGroups
    from crucible.v1 import trajectory_pb2

    def group(name, rewards, policy_version=5, received=None):
        return [trajectory_pb2.Trajectory(id=f"{name}/{i}", group_id=name, reward=r, policy_version=policy_version,
                                          group_received=received or len(rewards)) for i, r in enumerate(rewards)]

    flat = FlatGroups(max_policy_lag=1)
    for sample in group("learns", [1, 0, 1]) + group("solved", [1, 1, 1]) + group("old", [1, 0, 0], policy_version=3):
        flat.add(sample, version=5)
    assert flat.count == 2 and not flat.open  # "solved" (equal) and "old" (5 - 3 > 1), each once
    twice = group("twice", [0, 0])
    for sample in (twice[0], twice[0]):
        flat.add(sample, version=5)
    assert flat.count == 2 and "twice" in flat.open  # one of two samples, however often it arrives
    flat.add(twice[1], version=5)
    flat.add(group("waiting", [1, 1, 1], received=3)[0], version=5)
    assert flat.count == 3 and list(flat.open) == ["waiting"]
    unbounded = FlatGroups(max_policy_lag=-1)
    for sample in group("old", [1, 0], policy_version=0):
        unbounded.add(sample, version=50)
    assert unbounded.count == 0  # no lag bound: never too stale
