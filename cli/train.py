"""`crucible train`: a whole RL run on one machine, end to end through the five services.

    warm-start a fresh policy on the answer format -> measure the held-out pass rate
    -> start generator, sandbox-executor, verifier, reward-aggregator, learner (processes)
    -> feed training tasks over Kafka, show each policy step as it lands
    -> measure the held-out pass rate of the final policy -> report

Held-out tasks are never published to Kafka: they are scored here, greedily, with the same
task kind the verifier uses, on the checkpoint the learner wrote.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from crucible.shared import bus
from crucible.ml.kinds import registry
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint, path_from_uri, save_checkpoint
from crucible.ml.policy.sampling import SamplingParams, sample
from crucible.ml.policy.sft import warm_start
from crucible.ml.policy.tokenizer import ByteTokenizer
from crucible.shared.procs import free_port, stop_processes
from crucible.shared.settings import RunConfig, Settings
from crucible.ml.task_families import DEFAULT_OPS, digits_tasks, format_examples

SERVICES = ("sandbox_executor", "verifier", "reward_aggregator", "learner", "generator")


def builtin_config(seed: int = 0) -> RunConfig:
    """The built-in recipe's run configuration: where it departs from the defaults, and why."""
    return RunConfig(
        seed=seed,
        max_tokens=8,            # a digits answer is a few bytes
        max_policy_lag=0,
        # A KL pull towards the warm-started policy keeps the answer format while rewards
        # reshape which answer is given (without it a few noisy steps can unlearn the format).
        kl_coef=0.05,
        # Leave-one-out advantages stay within [-1, 1]; GRPO's division by a small group std
        # turned the last few wrong answers of a nearly solved group into huge updates.
        estimator="rloo",
    )


@dataclass
class TrainOptions:
    """The built-in job: the run configuration plus what only `crucible train` decides."""

    steps: int = 80
    minutes: float = 15.0
    config: RunConfig = field(default_factory=builtin_config)
    ops: tuple[str, ...] = DEFAULT_OPS
    group_size: int = 8
    heldout_size: int = 200
    eval_every: int = 20
    warm_start_steps: int = 100
    echo: callable = print

    @property
    def seed(self) -> int:
        return self.config.seed


@dataclass
class TrainReport:
    run_id: str
    heldout_before: float = 0.0
    heldout_after: float = 0.0
    train_pass_first: float = 0.0
    train_pass_last: float = 0.0
    steps: int = 0
    seconds: float = 0.0
    checkpoint: str = ""
    curve: list[dict] = field(default_factory=list)  # {t, version, reward_mean, pass_rate, heldout?}
    trajectories_per_s: float = 0.0
    learner_step_ms: float = 0.0


def heldout_pass_rate(checkpoint: Path, tasks) -> float:
    """Greedy answers of the checkpoint's policy to the held-out tasks, scored by their task kind."""
    model, _ = load_checkpoint(checkpoint)
    tok = ByteTokenizer()
    prompts = [tok.encode(registry.kind_of(t).render_prompt(t)) for t in tasks]
    out = sample(model, prompts, SamplingParams(temperature=0.0, top_p=1.0, max_tokens=8))
    return sum(registry.kind_of(t).score(t, s.text).passed for t, s in zip(tasks, out)) / len(tasks)


def service_env(settings: Settings, run_settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_")}
    env.update({
        "CRUCIBLE_HOME": str(settings.home),
        "CRUCIBLE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "CRUCIBLE_CLICKHOUSE_URL": settings.clickhouse_url,
        "CRUCIBLE_CLICKHOUSE_DATABASE": settings.clickhouse_database,
        "CRUCIBLE_LOG_LEVEL": settings.log_level,
        **({"CRUCIBLE_OTEL_ENDPOINT": settings.otel_endpoint} if settings.otel_endpoint else {}),
        **({"CRUCIBLE_OTEL_SPAN_FILE": str(settings.otel_span_file)} if settings.otel_span_file else {}),
        **run_settings,
    })
    return env


class Run:
    def __init__(self, settings: Settings, options: TrainOptions):
        self.options = options
        self.run_id = f"train-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.settings = settings.model_copy(update={
            **options.config.model_dump(), "run_id": self.run_id, "topic_prefix": f"crucible.{self.run_id}.",
            "consumer_group_prefix": f"crucible-{self.run_id}-",
        })
        self.dir = settings.home / "runs" / self.run_id
        self.processes: dict[str, subprocess.Popen] = {}
        self.heldout: list = []
        self.echo = options.echo

    def start_services(self, init_uri: str) -> None:
        s = self.settings
        config = s.run_config().model_copy(update={
            "init_checkpoint": init_uri,
            "lr_decay_steps": self.options.steps,  # the learning rate decays over the whole job
        })
        ports = {name: free_port() for name in ("sandbox", "verifier", "generator", "learner")}
        run_settings = {
            **config.environment(),
            "CRUCIBLE_TOPIC_PREFIX": s.topic_prefix,
            "CRUCIBLE_CONSUMER_GROUP_PREFIX": s.consumer_group_prefix,
            "CRUCIBLE_GENERATOR_BATCH_TASKS": str(config.groups_per_step),
            "CRUCIBLE_SANDBOX_GRPC_PORT": str(ports["sandbox"]),
            "CRUCIBLE_VERIFIER_GRPC_PORT": str(ports["verifier"]),
            "CRUCIBLE_VERIFIER_SANDBOX_TARGET": f"127.0.0.1:{ports['sandbox']}",
            "CRUCIBLE_GENERATOR_GRPC_PORT": str(ports["generator"]),
            "CRUCIBLE_LEARNER_GRPC_PORT": str(ports["learner"]),
            "CRUCIBLE_SANDBOX_WORKERS": "1",
        }
        env = service_env(s, run_settings)
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in SERVICES:
            args = [sys.executable, "-m", f"crucible.services.{name}"]
            if name == "sandbox_executor" and os.geteuid() != 0:
                args.append("--allow-weak-isolation")  # answer-only tasks here; results name what is missing
            with open(logs / f"{name}.log", "ab") as log:
                self.processes[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                        stdin=subprocess.DEVNULL)
        self.echo(f"      services started: {', '.join(SERVICES)} (logs in {logs})")

    def check_services(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                tail = (self.dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"service {name} exited with {proc.returncode}:\n" + "\n".join(tail))

    def stop_services(self) -> None:
        stop_processes(list(self.processes.values()), timeout=20)


async def train(settings: Settings, options: TrainOptions) -> TrainReport:
    run = Run(settings, options)
    echo = options.echo
    o = options
    report = TrainReport(run.run_id)
    heldout_stream = digits_tasks("heldout", seed=o.seed + 1000, ops=o.ops, group_size=1)
    heldout = run.heldout = [next(heldout_stream) for _ in range(o.heldout_size)]

    echo(f"[1/5] warm-starting a fresh policy on the answer format ({o.warm_start_steps} steps, random answers)")
    model = fresh_policy(o.seed)
    started = time.monotonic()
    loss = await asyncio.to_thread(warm_start, model, format_examples(2000, seed=o.seed, ops=o.ops),
                                   steps=o.warm_start_steps, batch_size=32, lr=3e-3, seed=o.seed)
    init = save_checkpoint(model, run.dir / "init", {"version": 0, "run_id": run.run_id})
    echo(f"      loss {loss:.3f} after {time.monotonic() - started:.1f}s; {model.num_parameters():,} parameters; "
         f"saved {init}")
    report.heldout_before = await asyncio.to_thread(heldout_pass_rate, init, heldout)
    echo(f"[2/5] held-out pass rate before RL: {report.heldout_before:.3f} ({len(heldout)} tasks never trained on)")

    await bus.ensure_topics(["tasks", "rollouts", "executions", "verdicts", "trajectories", "policy", "alerts"],
                            settings=run.settings)
    echo(f"[3/5] starting the five services for run {run.run_id}")
    run.start_services(init.as_uri())
    try:
        await _feed_and_follow(run, report)
    finally:
        run.stop_services()
    latest = max((p for p in (run.dir / "checkpoints").iterdir() if p.name.startswith("v")), key=lambda p: p.name)
    report.checkpoint = str(latest)
    report.heldout_after = await asyncio.to_thread(heldout_pass_rate, latest, heldout)
    echo(f"[5/5] held-out pass rate after RL: {report.heldout_after:.3f} (before: {report.heldout_before:.3f}); "
         f"final checkpoint {latest}")
    (run.dir / "report.json").write_text(json.dumps(report.__dict__, indent=1, default=str))
    return report


async def _feed_and_follow(run: Run, report: TrainReport) -> None:
    """Publishes training tasks a bounded distance ahead of the learner and prints each new version."""
    o = run.options
    s = run.settings
    echo = o.echo
    train_stream = digits_tasks("train", seed=o.seed, ops=o.ops, group_size=o.group_size)
    # Every version from the start of the run's policy topic; an observer: it dead-letters nothing.
    follower = bus.Reader(["policy"], None, settings=s, offsets={"policy": {}}, dead_letters=False)
    await follower.start()
    started = time.monotonic()
    published = 0
    version = -1
    last_step_ms = []
    echo(f"[4/5] training: {s.groups_per_step} tasks x {o.group_size} samples per step, up to {o.steps} steps "
         f"or {o.minutes:g} minutes")
    try:
        async with bus.Producer(s) as producer:
            while version < o.steps and time.monotonic() - started < o.minutes * 60:
                run.check_services()
                # Keep the generator busy, but never more than max_policy_lag + 1 steps ahead of the learner.
                allowed = (max(version, 0) + s.max_policy_lag + 1) * s.groups_per_step
                while published < allowed:
                    task = next(train_stream)
                    await producer.send("tasks", task, key=task.id)
                    published += 1
                for incoming in await follower.fetch(timeout_ms=500):
                    pv = incoming.message
                    if pv.version <= version:
                        continue
                    version = pv.version
                    if version == 0:
                        continue
                    m = pv.metrics
                    elapsed = time.monotonic() - started
                    point = {"t": round(elapsed, 1), "version": version, "reward_mean": m.reward_mean,
                             "pass_rate": m.pass_rate, "kl": m.kl, "step_ms": m.step_ms}
                    last_step_ms.append(m.step_ms)
                    if version == 1:
                        report.train_pass_first = m.pass_rate
                    report.train_pass_last = m.pass_rate
                    if version % o.eval_every == 0:
                        point["heldout"] = await asyncio.to_thread(
                            heldout_pass_rate, path_from_uri(pv.checkpoint_uri), run.heldout)
                    report.curve.append(point)
                    echo(f"      step {version:4d}/{o.steps}  reward {m.reward_mean:5.3f}  pass {m.pass_rate:5.3f}"
                         f"  kl {m.kl:6.4f}  stale {m.dropped_stale:3d}  {elapsed:6.1f}s"
                         + (f"  held-out {point['heldout']:.3f}" if "heldout" in point else ""))
    finally:
        await follower.stop()
    report.steps = max(version, 0)
    report.seconds = time.monotonic() - started
    report.trajectories_per_s = report.steps * s.groups_per_step * o.group_size / max(report.seconds, 1e-9)
    report.learner_step_ms = sorted(last_step_ms)[len(last_step_ms) // 2] if last_step_ms else 0.0
    if report.steps == 0:
        raise RuntimeError(f"no policy step within {o.minutes:g} minutes; see the logs in {run.dir / 'logs'}")
