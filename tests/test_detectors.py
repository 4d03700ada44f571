"""Window detectors over verdicts: each fires on its planted pattern, once per incident, with evidence,
and stays quiet on a clean stream."""
from __future__ import annotations

import random

from crucible.services.reward_aggregator.detectors import WindowDetectors
from crucible.shared import alerts
from crucible.v1 import execution_pb2, trajectory_pb2, verdict_pb2


def verdict(i: int, *, passed: bool, tampered: bool = False, components=None, violation: int = 0,
            ms: float = 0.0) -> verdict_pb2.Verdict:
    v = verdict_pb2.Verdict(sample=trajectory_pb2.Trajectory(id=f"s{i}", passed=passed), tampered=tampered,
                            components=components or {})
    if ms:
        v.execution.CopyFrom(execution_pb2.ExecutionResult(duration_ms=ms, violation=violation))
    return v


def stream(detectors, n, make):
    alerts = []
    for i in range(n):
        alerts += [(i, a) for a in detectors.observe(make(i))]
    return alerts


def clean(rng):
    def make(i):
        ok = rng.random() < 0.4
        return verdict(i, passed=ok, components={"answer_correct": float(ok), "format_ok": float(rng.random() < 0.8),
                                                  "length": rng.randrange(5, 30)}, ms=rng.uniform(8, 12),
                       violation=execution_pb2.VIOLATION_TIMEOUT if rng.random() < 0.02 else 0)
    return make


def test_a_clean_run_raises_nothing():
    rng = random.Random(0)
    assert stream(WindowDetectors("run", window=100), 2000, clean(rng)) == []


def test_a_component_rising_without_correctness_is_caught_once_with_examples():
    rng = random.Random(1)

    def hacked(i):
        ok = rng.random() < 0.4  # solving no more than before...
        return verdict(i, passed=ok, components={"answer_correct": float(ok), "format_ok": 1.0})  # ...format maxed
    detectors = WindowDetectors("run", window=100)
    low = lambda i: verdict(i, passed=rng.random() < 0.4, components={"format_ok": float(rng.random() < 0.5)})
    alerts = stream(detectors, 600, lambda i: low(i) if i < 300 else hacked(i))
    assert [a.kind for _, a in alerts] == ["component_without_correctness"]
    when, alert = alerts[0]
    assert 300 <= when < 500 and alert.details["component"] == "format_ok"
    assert float(alert.details["after"]) - float(alert.details["before"]) >= 0.2
    assert alert.details["examples"] and all(e.startswith("s") for e in alert.details["examples"].split(","))
    # the same climb, with the solved share rising with it, is learning, not hacking
    honest = WindowDetectors("run", window=100)
    assert stream(honest, 600, lambda i: verdict(i, passed=i >= 300 or rng.random() < 0.2, components={
        "format_ok": 1.0 if i >= 300 else float(rng.random() < 0.5)})) == []


def test_tampering_and_sandbox_drift_are_caught_and_re_fire_only_after_recovery():
    rng = random.Random(2)
    base = clean(rng)
    detectors = WindowDetectors("run", window=100)

    def phases(i):
        if 200 <= i < 300 or 500 <= i < 600:  # two incidents of forged passes
            return verdict(i, passed=False, tampered=rng.random() < 0.2)
        if 700 <= i < 800:  # the sandbox starts timing out and slowing down
            return verdict(i, passed=False, ms=rng.uniform(40, 60), violation=execution_pb2.VIOLATION_TIMEOUT
                           if rng.random() < 0.5 else 0)
        return base(i)

    kinds = [(i // 100, a.kind) for i, a in stream(detectors, 900, phases)]
    assert kinds == [(2, "tamper_rate"), (5, "tamper_rate"), (7, "sandbox_timeouts"), (7, "sandbox_slowdown")]


def test_per_sample_alerts_are_one_per_incident_with_a_cool_down():
    now = [0.0]
    cooldown = alerts.Cooldown(60, clock=lambda: now[0])
    admitted = []
    # a paid canary every 10 s for 5 minutes, a quiet 2 minutes, then another burst
    for t in list(range(0, 300, 10)) + list(range(420, 450, 10)):
        now[0] = float(t)
        admitted.append((t, *cooldown.admit("canary_passed")))
    assert [(t, held) for t, new, held in admitted if new] == [(0, 0), (420, 29)]
    # keys are separate incidents
    now[0] = 425.0
    assert cooldown.admit("tamper") == (True, 0)


def test_more_tests_passed_because_the_tasks_have_more_tests_is_not_a_hack():
    """`tests_passed` is a count: tasks with more tests raised its mean with nothing gamed, and an honest
    run was alerted (component_without_correctness). It is watched as the share of the task's tests."""
    rng = random.Random(2)

    def honest(i):
        total = 3.0 if i < 300 else 12.0  # the curriculum moves on to tasks with four times the tests
        ok = rng.random() < 0.4
        share = 1.0 if ok else rng.choice([0.0, 1 / 3, 2 / 3])
        return verdict(i, passed=ok, components={"tests_passed": round(share * total), "tests_total": total,
                                                  "timed_out": float(i >= 300 and rng.random() < 0.3)})
    assert stream(WindowDetectors("run", window=100), 600, honest) == []


def test_an_episodes_calls_run_in_the_sandbox_count_as_runs_and_their_violations_are_seen():
    """A multi-turn episode's verdict carries no execution of its own: its calls that ran in the sandbox
    are runs for the share stopped for a violation, and calls of tools that run elsewhere are none. A
    call's time is not a run's (it holds the wait for the pool, and an environment may replay earlier calls
    in each): episodes whose calls take longer raise no slowdown."""
    rng = random.Random(3)

    def episode(i, stopped: bool, slow: bool):
        v = verdict(i, passed=False)
        for n in range(3):
            turn = v.episode.turns.add(sandboxed=n < 2, execution_ms=rng.uniform(8, 12) * (20 if slow else 1))
            if stopped and n < 2:  # both its sandboxed calls stopped
                turn.violation = execution_pb2.VIOLATION_MEMORY
        return v

    detectors = WindowDetectors("run", window=100)
    alerts = stream(detectors, 400, lambda i: episode(i, stopped=200 <= i < 300, slow=i >= 100) if i % 2
                    else clean(rng)(i))
    assert [(i // 100, a.kind) for i, a in alerts] == [(2, "sandbox_timeouts")]
    examples = alerts[0][1].details["examples"].split(",")
    assert len(examples) == len(set(examples)) == 5  # an episode named once, however many of its calls stopped
    assert detectors.baseline.ran == 150 and detectors.baseline.timed == 50  # two runs an episode, not three
