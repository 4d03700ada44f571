"""Reward-hacking and health detectors over a stream of verdicts, in windows, each alert with its evidence.

The aggregator feeds every verdict it joins to `WindowDetectors.observe`; every `window` verdicts
the detectors compare the newest window with the first one (the run's baseline) and with their
own thresholds:

- `tamper_rate`: the share of verdicts the verifier caught forging a pass reaches `tamper_rate`;
- `component_without_correctness`: a reward component's mean rose by `component_gain` or more
  since the baseline while the solved share rose by less than `correctness_gain` (the policy
  found a component it can raise without solving the task: format, length, partial tests...);
- `sandbox_timeouts`: the share of sandbox runs (an episode's calls run there each count as one)
  stopped for a violation (timeout, memory, CPU, output) rose by `violation_gain` or more since the
  baseline;
- `sandbox_slowdown`: single-turn sandbox runs take `slowdown_factor` times as long as in the baseline.

A detector that fired stays quiet until it has recovered for a whole window (one incident, one
alert). Each alert names the window, the values compared and example trajectory ids.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from crucible.shared import alerts
from crucible.v1 import alert_pb2, verdict_pb2

# Components that describe a sample rather than reward it: never suspects.
NEUTRAL = {"length", "truncated", "turns", "tool_calls", "failed_calls", "tests_total", "answered", "scoring_failed",
           "timed_out", "tampered"}  # tampered: the tamper_rate detector watches it
# Components that are counts of another: watched as their share of it (tests passed rose with nothing gamed
# when the tasks drawn had more tests, and an honest run was alerted).
SHARES = {"tests_passed": "tests_total"}


@dataclass
class Window:
    count: int = 0
    passed: int = 0
    tampered: int = 0
    ran: int = 0         # sandbox runs: a single-turn sample's, and each of an episode's calls run there
    violations: int = 0  # ... of them stopped for a violation
    timed: int = 0       # single-turn runs, whose duration_ms is the sandbox's own time for the job
    run_ms: float = 0.0  # ... their time
    components: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    seen: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, v: verdict_pb2.Verdict) -> None:
        self.count += 1
        self.passed += int(v.sample.passed)
        if v.tampered:
            self.tampered += 1
            self._example("tamper", v.sample.id)
        for name, value in v.components.items():
            if name in SHARES:
                whole = v.components.get(SHARES[name], 0.0)
                value = value / whole if whole > 0 else 0.0
            self.components[name] += value
            self.seen[name] += 1
            if value > 0 and not v.sample.passed:
                self._example(f"component:{name}", v.sample.id)
        if v.HasField("execution") and not v.execution.not_run:
            self._ran(v.execution.violation, v.sample.id)
            self.timed += 1
            self.run_ms += v.execution.duration_ms
        # An episode's calls run in the sandbox are runs too, for the share stopped; not for the time a run
        # takes: a turn's time is its whole call's (waiting for the pool included), and an environment may
        # replay earlier calls in each (python: every earlier cell), so it grows with the turn.
        for turn in v.episode.turns:
            if turn.sandboxed:
                self._ran(turn.violation, v.sample.id)

    def _ran(self, violation: int, sample_id: str) -> None:
        self.ran += 1
        if violation:
            self.violations += 1
            self._example("violation", sample_id)

    def _example(self, what: str, sample_id: str) -> None:
        if len(self.examples[what]) < 5 and sample_id not in self.examples[what]:
            self.examples[what].append(sample_id)

    def counts(self) -> dict:
        """What the window counted (its examples aside), as plain data: a baseline kept across restarts."""
        return {"count": self.count, "passed": self.passed, "tampered": self.tampered, "ran": self.ran,
                "violations": self.violations, "timed": self.timed, "run_ms": self.run_ms,
                "components": dict(self.components), "seen": dict(self.seen)}

    @classmethod
    def of_counts(cls, counts: dict) -> "Window":
        window = cls(**{k: counts[k] for k in ("count", "passed", "tampered", "ran", "violations", "timed", "run_ms")})
        window.components.update(counts["components"])
        window.seen.update(counts["seen"])
        return window

    def mean(self, component: str) -> float:
        return self.components[component] / self.seen[component] if self.seen[component] else 0.0

    @property
    def solved(self) -> float:
        return self.passed / self.count if self.count else 0.0


@dataclass
class WindowDetectors:
    run_id: str
    window: int = 256
    tamper_rate: float = 0.05
    component_gain: float = 0.2
    correctness_gain: float = 0.05
    violation_gain: float = 0.1
    slowdown_factor: float = 3.0
    baseline: Window | None = None
    current: Window = field(default_factory=Window)
    incidents: alerts.Incidents = field(default_factory=alerts.Incidents)
    windows: int = 0

    def state(self) -> dict:
        """What a restarted aggregator needs to go on judging as before: the baseline (else the first
        window after a restart, of a policy that may have learnt a hack meanwhile, became the baseline,
        and the hack was never alerted), how many windows were judged (alerts are named by it: a new
        one took an old one's name, and the store kept one of them) and which incidents are under way
        (alerted once already)."""
        return {"windows": self.windows, "baseline": self.baseline.counts() if self.baseline else None,
                "active": sorted(self.incidents.active)}

    def restore(self, state: dict) -> None:
        self.windows = int(state["windows"])
        self.baseline = Window.of_counts(state["baseline"]) if state.get("baseline") else None
        self.incidents.active = set(state.get("active", ()))

    def observe(self, verdict: verdict_pb2.Verdict) -> list[alert_pb2.Alert]:
        """Adds one verdict; at the end of each window, the alerts that window raises (else [])."""
        if verdict.sample.heldout:
            return []
        self.current.add(verdict)
        if self.current.count < self.window:
            return []
        done, self.current = self.current, Window()
        self.windows += 1
        if self.baseline is None:
            self.baseline = done
        return self._judge(done)

    def _judge(self, now: Window) -> list[alert_pb2.Alert]:
        base = self.baseline
        firing: dict[str, tuple[str, dict[str, str], list[str]]] = {}
        rate = now.tampered / now.count
        if rate >= self.tamper_rate:
            firing["tamper_rate"] = (f"{rate:.1%} of the last {now.count} verdicts forged a pass "
                                     f"(threshold {self.tamper_rate:.0%})",
                                     {"rate": f"{rate:.4f}", "tampered": str(now.tampered)}, now.examples["tamper"])
        for name in sorted(now.seen):
            if name in NEUTRAL or name == "answer_correct" or not base.seen.get(name):
                continue
            gain, solved_gain = now.mean(name) - base.mean(name), now.solved - base.solved
            if gain >= self.component_gain and solved_gain < self.correctness_gain:
                firing[f"component_without_correctness:{name}"] = (
                    f"reward component {name!r} rose {base.mean(name):.3f} -> {now.mean(name):.3f} while the solved "
                    f"share went {base.solved:.3f} -> {now.solved:.3f}",
                    {"component": name, "before": f"{base.mean(name):.4f}", "after": f"{now.mean(name):.4f}",
                     "solved_before": f"{base.solved:.4f}", "solved_after": f"{now.solved:.4f}"},
                    now.examples[f"component:{name}"])
        if now.ran and base.ran:
            before, after = base.violations / base.ran, now.violations / now.ran
            if after - before >= self.violation_gain:
                firing["sandbox_timeouts"] = (
                    f"sandbox runs stopped for a violation went {before:.1%} -> {after:.1%}",
                    {"before": f"{before:.4f}", "after": f"{after:.4f}", "runs": str(now.ran)}, now.examples["violation"])
        if now.timed and base.timed:
            slow_before, slow_after = base.run_ms / base.timed, now.run_ms / now.timed
            if slow_before > 0 and slow_after >= self.slowdown_factor * slow_before:
                firing["sandbox_slowdown"] = (
                    f"sandbox runs take {slow_after:.0f} ms on average, {slow_after / slow_before:.1f}x the "
                    f"{slow_before:.0f} ms of the first window", {"before_ms": f"{slow_before:.1f}",
                                                                  "after_ms": f"{slow_after:.1f}"}, [])
        return [alerts.new(f"{self.run_id}/{key}/{self.windows}", key.split(":")[0], message, self.run_id,
                           {**details, "window": str(self.windows), "window_verdicts": str(now.count),
                            "examples": ",".join(examples)})
                for key, (message, details, examples) in self.incidents.starting(firing)]
