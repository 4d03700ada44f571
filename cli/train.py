"""`crucible train [RECIPE.toml]`: a whole RL run on one machine, end to end through the five services.

    the recipe's model (the built-in policy warm-started on the answer format, or a Hugging Face model)
    -> start generator, sandbox-executor, verifier, reward-aggregator, learner (processes)
    -> the evaluator's held-out pass rate of the starting policy -> feed training tasks over Kafka,
       show each policy step -> measure the held-out pass rate of the final policy -> report

Held-out tasks are never published on the training topic (the generator would refuse them): the
evaluator reads them from their own topic; the final policy is sampled here, greedily, and scored by
the run's verifier, with the same task kinds as training.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import logging
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from crucible.cli.recipe import Recipe
from crucible.local.services import SERVICES, Services, stop_recorded
from crucible.ml import evaluation, models, task_sources
from crucible.ml.policy.backends import backend_for
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.policy.model import Policy, PolicyConfig
from crucible.ml.policy.sft import warm_start
from crucible.ml.task_families import DEFAULT_OPS, format_examples
from crucible.ml.tasks import task_problems
from crucible.services.generator.batcher import Batcher
from crucible.services.learner.groups import informative
from crucible.services.learner.trainer import UNINFORMATIVE
from crucible.shared import bus, integrity, rpc, store
from crucible.shared.procs import free_ports
from crucible.shared.settings import Settings, run_id_problem
from crucible.shared.store import queries
from crucible.shared.text import shown
from crucible.v1 import alert_pb2

log = logging.getLogger("crucible.train")

CPU_EVERY = 10  # versions between two readings of each process's CPU time
STALL_S = 20.0  # no new version for this long: the learner is short of samples; feed it more tasks
# While versions come at least this often, the step after the lag bound's last one is fed a version
# early, asking for the next version (min_policy_version): the generator holds those tasks until it
# has loaded that version (at most Batcher.MIN_VERSION_WAIT_S) and samples them at once, instead of
# waiting for this process to see the version and feed them (a hop of about 25-50 ms a step here).
FEED_AHEAD_BELOW_S = Batcher.MIN_VERSION_WAIT_S / 6
STARTING_EVALUATION_S = 300.0  # the longest wait for the evaluator's score of the starting policy


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
    curve: list[dict] = field(default_factory=list)  # {t, version, reward_mean, pass_rate, kl, step_ms}
    evaluations: list[dict] = field(default_factory=list)  # the evaluator's: {t, version, heldout, eval_ms}
    alerts: list[dict] = field(default_factory=list)  # {t, version (the learner's then), kind, severity, message}
    trajectories_per_s: float = 0.0
    learner_step_ms: float = 0.0
    step_breakdown: dict = field(default_factory=dict)  # median ms over versions: `crucible query step-time`
    cpu_ms_per_step: dict = field(default_factory=dict)  # CPU of each process (and its children) per version
    tasks_fed_early: int = 0  # fed a version early, asking for the next one (FEED_AHEAD_BELOW_S)


def cpu_snapshot(run: "Run") -> dict[str, float]:
    """CPU seconds used so far by each service of the run, this process, and the broker and the store
    where they run on this machine (whoever started them)."""
    from crucible.local.services import cpu_seconds, listener_pid

    if run.stack_pids is None:
        run.stack_pids = {"broker": listener_pid(run.settings.kafka_bootstrap),
                          "store": listener_pid(run.settings.clickhouse_url)}
    used = run.services.cpu_seconds()
    used.update(cpu_seconds(run.stack_pids))
    mine = os.times()
    used["train (this process)"] = mine.user + mine.system
    return used


def cpu_per_step(first: tuple[int, dict], last: tuple[int, dict]) -> dict[str, float]:
    """CPU milliseconds per policy version of each process between two snapshots, largest first."""
    steps = last[0] - first[0]
    if steps <= 0:
        return {}
    per = {name: (used - first[1].get(name, 0.0)) * 1000 / steps for name, used in last[1].items()}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def step_breakdown(settings: Settings, run_id: str) -> dict[str, float]:
    """The median over the run's versions of each part of a step (`crucible query step-time`); empty
    where the spans are not in the store (CRUCIBLE_OTEL_STORE_SPANS=false, a collector elsewhere)."""
    try:
        columns, rows = queries.run(store.connect(settings), "step-time", run=run_id)
    except Exception as exc:  # a report without it is still a report
        log.warning("no step-time breakdown for %s: %s", run_id, exc)
        return {}
    return {c: statistics.median(r[i] for r in rows) for i, c in enumerate(columns)
            if c.endswith("_ms") and rows}


async def heldout_pass_rate(run: "Run", checkpoint: Path, tasks) -> float:
    """Greedy answers of the checkpoint's policy to the held-out tasks, scored by the run's verifier."""
    backend = await asyncio.to_thread(backend_for, run.settings, checkpoint.as_uri())
    async with evaluation.verifier(run.verifier_address) as verify, evaluation.sandbox(run.sandbox_address) as execute:
        return (await evaluation.evaluate(backend, tasks, verify, max_tokens=run.settings.max_tokens, execute=execute,
                                          max_episode_tokens=run.settings.max_episode_tokens)).pass_rate


async def starting_pass_rate(run: "Run", init: Path, tasks) -> float:
    """The held-out pass rate of the run's starting policy (version 0) as the run's evaluator scores it,
    read from the run's evaluations topic: scored here as well, it was scored twice, and the evaluator's
    turn (0.7-1.3 s of both cores here) ran beside the first training steps. Waits for it before the
    first task is fed; scores it here after all where the evaluator has not within
    STARTING_EVALUATION_S (a service that keeps dying stops the run meanwhile)."""
    s = run.settings
    started = said = time.monotonic()
    async with bus.Reader(["evaluations"], None, settings=s, offsets={"evaluations": {}}, dead_letters=False,
                          trusted=True) as reader:
        while (waited := time.monotonic() - started) < STARTING_EVALUATION_S:
            run.check_services()
            for incoming in await reader.fetch(timeout_ms=500):
                if incoming.message.run_id == s.run_id and incoming.message.policy_version == 0:
                    return incoming.message.pass_rate
            if time.monotonic() - said >= 30:
                said = time.monotonic()
                run.echo(f"      waiting for the evaluator to score the starting policy ({waited:.0f}s)")
    run.echo(f"      the evaluator has not scored the starting policy in {STARTING_EVALUATION_S:.0f}s "
             "(see its log); scoring it here")
    return await heldout_pass_rate(run, init, tasks)


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
        "CRUCIBLE_OTEL_TRACE_RATIO": str(settings.otel_trace_ratio),
        **_connection_env(settings),
        **run_settings,
    })
    return env


# What a run's services need to reach what the driver reaches and to trust what it trusts: the same key
# (the driver reads trusted: a service signing with another key would publish nothing it can read), the
# same credentials. Passed where set, as the settings hold them.
_PASSED_SETTINGS = ("integrity_key", "rpc_token", "clickhouse_user", "clickhouse_password", "kafka_security_protocol",
                    "kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password", "kafka_ssl_cafile",
                    "rpc_tls_cert", "rpc_tls_key", "rpc_tls_ca")


def _connection_env(settings: Settings) -> dict[str, str]:
    env = {}
    for name in _PASSED_SETTINGS:
        value = getattr(settings, name)
        if value is None:
            continue
        value = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
        env[f"CRUCIBLE_{name.upper()}"] = value
    return env


def run_prefixes(run_id: str) -> tuple[str, str]:
    """A run's topic prefix and its consumer groups' (faust names the aggregator's topics after its group)."""
    return f"crucible.{run_id}.", f"crucible-{run_id}-"


REPORT = "report.json"  # in the run's folder once the run has finished


async def forget_finished_runs(settings: Settings, echo=print) -> None:
    """Deletes the topics of the runs under `settings.home` that have finished (their report written):
    what they carried is in the store and the run's folder, and a broker that keeps every past run's
    topics slows down for the runs to come (3,800 partitions here: a metadata answer took 7 ms, and
    the broker's CPU a step of the built-in recipe rose by a fifth). An interrupted run keeps them, to
    be resumed."""
    finished = [p.name for p in (settings.home / "runs").glob("*") if (p / REPORT).exists()]
    if not finished:
        return
    try:
        deleted = await bus.delete_topics([prefix for run_id in finished for prefix in run_prefixes(run_id)],
                                          settings=settings)
    except Exception as exc:  # the broker gone: a finished run stays finished, the next run deletes them
        echo(f"      could not delete finished runs' topics ({type(exc).__name__}: {exc}); the next run will")
        return
    if deleted:
        runs = {run_id for run_id in finished for t in deleted if t.startswith(run_prefixes(run_id))}
        echo(f"      deleted the {len(deleted)} topics of {len(runs)} finished run(s) (their results are in "
             "the store and under runs/)")


class Run:
    def __init__(self, settings: Settings, recipe: Recipe, echo=print, name: str = "train", run_id: str = ""):
        self.recipe = recipe
        self.run_id = run_id or f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.published = 0  # training tasks published so far (a resumed run starts past the earlier ones)
        topic_prefix, group_prefix = run_prefixes(self.run_id)
        self.settings = settings.model_copy(update={
            **recipe.run_config().model_dump(), "run_id": self.run_id, "topic_prefix": topic_prefix,
            "consumer_group_prefix": group_prefix,
        })
        self.dir = settings.home / "runs" / self.run_id
        self.services = Services(self.dir, {}, echo)
        self.heldout: list = []
        self.echo = echo
        self.verifier_address = ""
        self.sandbox_address = ""
        self.stack_pids: dict[str, int | None] | None = None  # the broker's and the store's, where local

    def start_services(self, init_uri: str, names: tuple[str, ...] = SERVICES) -> None:
        s = self.settings
        config = s.run_config().model_copy(update={
            "init_checkpoint": init_uri,
            # the learning rate decays over the whole job, unless the recipe says otherwise
            "lr_decay_steps": s.lr_decay_steps or self.recipe.budget.steps,
        })
        served = ("control", "sandbox", "verifier", "generator", "learner")  # the gRPC ports, chosen together
        ports = dict(zip(served, free_ports(len(served))))
        run_settings = {
            **config.environment(),
            "CRUCIBLE_TOPIC_PREFIX": s.topic_prefix,
            "CRUCIBLE_CONSUMER_GROUP_PREFIX": s.consumer_group_prefix,
            "CRUCIBLE_GENERATOR_BATCH_TASKS": str(config.groups_per_step),
            "CRUCIBLE_CONTROL_GRPC_PORT": str(ports["control"]),
            "CRUCIBLE_SANDBOX_GRPC_PORT": str(ports["sandbox"]),
            "CRUCIBLE_VERIFIER_GRPC_PORT": str(ports["verifier"]),
            "CRUCIBLE_VERIFIER_SANDBOX_TARGET": f"127.0.0.1:{ports['sandbox']}",
            "CRUCIBLE_EVALUATOR_VERIFIER_TARGET": f"127.0.0.1:{ports['verifier']}",
            "CRUCIBLE_GENERATOR_GRPC_PORT": str(ports["generator"]),
            "CRUCIBLE_LEARNER_GRPC_PORT": str(ports["learner"]),
            "CRUCIBLE_SANDBOX_WORKERS": "1",
        }
        self.verifier_address = f"127.0.0.1:{ports['verifier']}"
        self.sandbox_address = f"127.0.0.1:{ports['sandbox']}"
        self.services.env = service_env(s, run_settings)
        self.services.start_all(names)
        self.echo(f"      services started: {', '.join(names)} (logs in {self.dir / 'logs'})")

    def start_service(self, name: str) -> None:
        """Starts (or starts again) one service of the run as a process, logging to logs/<name>.log."""
        self.services.start(name)

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return self.services.processes

    def metrics_port_file(self, name: str) -> Path:
        """Where service `name` writes the port of its Prometheus /metrics endpoint."""
        return self.services.metrics_port_file(name)

    def check_services(self) -> None:
        """A service that died is started again (local/services.py); one that keeps dying stops the run."""
        self.services.check()

    def stop_services(self) -> None:
        self.services.stop()


class ResumeError(ValueError):
    """A run that cannot be resumed; the text says why."""


RUN_STATE = "run.json"  # in the run's folder: what `--resume` needs (the recipe, the start, the first evaluation)


def resumable(settings: Settings, run_id: str) -> Recipe:
    """The recipe of the stopped run `run_id`, as it ran."""
    problem = run_id_problem(run_id)
    if problem:
        raise ResumeError(problem)
    state_file = settings.home / "runs" / run_id / RUN_STATE
    if state_file.with_name(REPORT).exists():
        raise ResumeError(f"run {run_id!r} has finished (its report is {state_file.with_name(REPORT)}): there is "
                          "nothing left of it to resume; start a new run")
    if not state_file.exists():
        runs = sorted(p.name for p in (settings.home / "runs").glob("*") if (p / RUN_STATE).exists())
        raise ResumeError(f"no resumable run {run_id!r} under {settings.home / 'runs'}"
                          + (f" (resumable: {', '.join(runs[-5:])})" if runs else " (none is resumable)")
                          + "; a run is resumable once its first held-out evaluation is done")
    try:
        state = json.loads(state_file.read_text())
        recipe = Recipe.model_validate(state["recipe"])
    except (ValueError, KeyError, TypeError) as exc:  # JSON or validation errors: a damaged file
        raise ResumeError(f"{state_file} cannot be read back ({type(exc).__name__}: {str(exc)[:300]})") from None
    recipe.source = Path(state["recipe_source"]) if state.get("recipe_source") else None
    return recipe


def task_streams(recipe: Recipe, seed: int):
    """(the endless stream of the recipe's training tasks, its held-out tasks)."""
    return task_sources.streams(
        recipe.tasks.sources, seed=seed, group_size=recipe.sampling.group_size,
        heldout_fraction=recipe.heldout.fraction,
        heldout_file=recipe.path(recipe.heldout.file) if recipe.heldout.file else None,
        heldout_size=recipe.heldout.size, base=recipe.source.parent if recipe.source else Path.cwd())


def preflight(settings: Settings, recipe: Recipe) -> None:
    """What a run of `recipe` would refuse, found before anything starts (Kafka, the store, a service):
    its model, and every task source with the held-out tasks (files read, names known, a first task
    made). Raises what train() would: ModelError, TaskFileError, ValueError. A generated task the
    generator would refuse is found here too (the first PREFLIGHT_TASKS, and every held-out one): a
    source all of whose tasks are refused (a reasoning-gym generator whose scorer pays any answer)
    left a run waiting for samples that never came."""
    if recipe.model.name != "builtin":
        models.resolve(recipe.model.name, settings)
    train_tasks, heldout = task_streams(recipe, recipe.algorithm.seed)
    for task in [*itertools.islice(train_tasks, PREFLIGHT_TASKS), *heldout]:
        problems = task_problems(task)
        if problems:
            raise ValueError(f"task {task.id!r} ({task.kind}) of the recipe's task sources would be refused: "
                             + "; ".join(problems))


PREFLIGHT_TASKS = 32


async def train(settings: Settings, recipe: Recipe, echo=print, resume: str = "") -> TrainReport:
    """A whole run; with `resume`, the stopped run of that id goes on from its newest checkpoint, its
    consumers from their committed offsets, and the task feed from where it stopped."""
    run = Run(settings, recipe, echo, run_id=resume)
    s = run.settings
    report = TrainReport(run.run_id)
    await forget_finished_runs(settings, echo)  # any left behind (a broker that was down when they ended)
    train_tasks, heldout = task_streams(recipe, s.seed)
    run.train_tasks, run.heldout = train_tasks, heldout
    secret = integrity.key(s)
    for task in heldout:  # scored here, through the run's verifier, which wants them signed
        integrity.sign_task(task, secret)

    if resume:
        state = json.loads((run.dir / RUN_STATE).read_text())
        run.services.claim()  # refused while the run is still going somewhere
        left = stop_recorded(run.dir)
        if left:
            echo(f"      stopped what the interrupted run left running: {', '.join(left)}")
        init = Path(state["init"])
        report.heldout_before = state["heldout_before"]
        # The task stream is the seed's: skip what the stopped run published (the generator has it).
        run.published = await bus.published("tasks", settings=s)
        for _ in range(run.published):
            next(train_tasks)
        echo(f"[1/5] resuming run {run.run_id}: {run.published} training tasks were published before")
    else:
        init = await _initial_policy(run, settings)
        await bus.ensure_topics(["tasks", "rollouts", "executions", "verdicts", "trajectories", "policy", "alerts",
                                 "heldout", "evaluations", "actions", "observations", "episodes"], settings=s)
        async with bus.Producer(s) as producer:  # for the evaluator; the generator would refuse them as tasks
            for task in heldout:
                await producer.send("heldout", task, key=task.id)
            await producer.flush()
    echo(f"[2/5] starting the services for run {run.run_id}")
    run.start_services(init.as_uri())
    try:
        await rpc.wait_serving(run.verifier_address, "crucible.v1.Verifier", timeout=120)
        if not resume:
            report.heldout_before = await starting_pass_rate(run, init, heldout)
            (run.dir / RUN_STATE).write_text(json.dumps({
                "run_id": run.run_id, "recipe": recipe.model_dump(mode="json"),
                "recipe_source": str(recipe.source) if recipe.source else "", "init": str(init),
                "heldout_before": report.heldout_before}, indent=1))
        echo(f"[3/5] held-out pass rate before RL: {report.heldout_before:.3f} "
             f"({len(heldout)} tasks never trained on)")
        await _feed_and_follow(run, report)
        latest = max((p for p in (run.dir / "checkpoints").iterdir() if p.name.startswith("v")),
                     key=lambda p: p.name)
        report.checkpoint = str(latest)
        report.heldout_after = await heldout_pass_rate(run, latest, heldout)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if (run.dir / RUN_STATE).exists():
            echo(f"interrupted; go on with: crucible train --resume {run.run_id}")
        raise
    finally:
        run.stop_services()
    report.step_breakdown = await asyncio.to_thread(step_breakdown, settings, run.run_id)
    echo(f"[5/5] held-out pass rate after RL: {report.heldout_after:.3f} (before: {report.heldout_before:.3f}); "
         f"final checkpoint {report.checkpoint}")
    (run.dir / REPORT).write_text(json.dumps(report.__dict__, indent=1, default=str))
    await forget_finished_runs(settings, echo)
    return report


def format_only_examples(recipe: Recipe, seed: int) -> list:
    """What the built-in policy's warm start trains on: the answer format of the recipe's digits tasks
    and the call format of its environments that have one (lookup), every answer random."""
    from crucible.ml import envs

    examples: list = []
    for source in recipe.tasks.sources:
        if source.family == "digits":  # whatever grades it
            examples += format_examples(2000, seed=seed, ops=tuple(source.ops or DEFAULT_OPS))
        elif source.environment and hasattr(envs.get(source.environment), "format_examples"):
            examples += envs.get(source.environment).format_examples(2000, seed=seed)
    return examples


def warm_started_policy(recipe: Recipe, seed: int) -> tuple[Policy, float | None]:
    """A fresh built-in policy drawn at the recipe's init_scale, then warm-started on the answer format
    (`format_only_examples`); the warm start's last loss, or None when there was none."""
    model = fresh_policy(seed, PolicyConfig(initializer_range=recipe.model.init_scale))
    examples = format_only_examples(recipe, seed)
    if not (recipe.model.warm_start_steps and examples):
        return model, None
    return model, warm_start(model, examples, steps=recipe.model.warm_start_steps, batch_size=32, lr=3e-3, seed=seed)


async def _initial_policy(run: Run, settings: Settings) -> Path:
    """The starting checkpoint: the built-in policy (warm-started on the digits answer format), or the
    recipe's Hugging Face model as it is."""
    recipe, echo, s = run.recipe, run.echo, run.settings
    if recipe.model.name != "builtin":
        folder = models.resolve(recipe.model.name, settings)
        echo(f"[1/5] model {recipe.model.name}: {folder}")
        return folder
    if recipe.model.warm_start_steps:
        echo(f"[1/5] warm-starting a fresh policy on the answer format ({recipe.model.warm_start_steps} steps, "
             "random answers)")
    started = time.monotonic()
    model, loss = await asyncio.to_thread(warm_started_policy, recipe, s.seed)
    if loss is not None:
        echo(f"      loss {loss:.3f} after {time.monotonic() - started:.1f}s; {model.num_parameters():,} parameters")
    else:
        echo(f"[1/5] a fresh built-in policy, nothing to warm-start on ({model.num_parameters():,} parameters)")
    return save_checkpoint(model, run.dir / "init", {"version": 0, "run_id": run.run_id})


class FlatGroups:
    """Counts the complete groups on the trajectories topic that dynamic sampling filters (rewards all
    equal, or sampled too many versions ago), so that each one is replaced by another task."""

    def __init__(self, max_policy_lag: int):
        self.max_lag = max_policy_lag
        self.open: dict[str, dict[str, object]] = {}  # group id -> its samples so far, by sample id
        self.count = 0

    def add(self, sample, version: int) -> None:
        """One sample read, `version` the newest the learner published: its group counted once complete
        (as many samples as the aggregator emitted; a sample sent twice counts once)."""
        members = self.open.setdefault(sample.group_id, {})
        members.setdefault(sample.id, sample)
        first = next(iter(members.values()))
        if len(members) >= first.group_received:
            del self.open[sample.group_id]
            stale = 0 <= self.max_lag < version - max(m.policy_version for m in members.values())
            self.count += stale or not informative(list(members.values()))


@dataclass
class TaskFeed:
    """How many training tasks `crucible train` publishes next, and the policy version each asks for
    (min_policy_version): never more than max_policy_lag + 1 steps ahead of the version reached, plus
    the steps fed because the learner stalled (`extra`) and a task for each group dynamic sampling
    filtered; and, fed early, the step after those, asking for the version after the one reached."""

    groups_per_step: int
    max_policy_lag: int
    published: int = 0  # tasks that may be sampled with the version reached (or were sampled)
    held: int = 0  # tasks fed early, each asking for the version after the one reached
    fed_early: int = 0
    version: int = -1

    def due(self, *, extra: int = 0, filtered: int = 0, early: bool = False) -> list[int]:
        """The min_policy_version of each task to publish now (counted as published). A task is fed
        because the learner reached a version: sampled with an older one, its group could be too stale
        for the step it is meant for. A step fed because the learner stalled is wanted now: it is not held."""
        reached = max(self.version, 0)
        allowed = (reached + self.max_policy_lag + 1 + extra) * self.groups_per_step + filtered
        now = max(allowed - self.published, 0)
        ahead = max((self.groups_per_step if early else 0) - self.held, 0)
        self.published += now
        self.held += ahead
        self.fed_early += ahead
        return [reached] * now + [reached + 1] * ahead

    def reached(self, version: int) -> None:
        """The learner published `version`: the tasks fed early may be sampled from now on."""
        if version > self.version:
            self.version = version
            self.published, self.held = self.published + self.held, 0


def feeds_ahead(max_policy_lag: int, intervals: list[float]) -> bool:
    """Whether the step after the lag bound's last one is fed a version early (FEED_AHEAD_BELOW_S):
    with a lag bound, once versions are known to come well within the time the generator holds a
    task for the version it asks for (a step held longer is sampled with an older version and lost
    as stale)."""
    return max_policy_lag >= 0 and bool(intervals) and statistics.median(intervals) < FEED_AHEAD_BELOW_S


async def _feed_and_follow(run: Run, report: TrainReport) -> None:
    """Publishes training tasks a bounded distance ahead of the learner and prints each new version."""
    recipe, s, echo = run.recipe, run.settings, run.echo
    budget = recipe.budget
    # Every version from the start of the run's policy topic; an observer: it dead-letters nothing.
    follower = bus.Reader(["policy"], None, settings=s, offsets={"policy": {}}, dead_letters=False, trusted=True)
    await follower.start()
    evaluations = bus.Reader(["evaluations"], None, settings=s, offsets={"evaluations": {}}, dead_letters=False,
                             trusted=True)
    await evaluations.start()
    alerts = bus.Reader(["alerts"], None, settings=s, offsets={"alerts": {}}, dead_letters=False, trusted=True)
    await alerts.start()
    trajectories = bus.Reader(["trajectories"], None, settings=s, offsets={"trajectories": {}}, dead_letters=False,
                              trusted=True)
    await trajectories.start()
    started, began = time.monotonic(), time.time()
    feed = TaskFeed(s.groups_per_step, s.max_policy_lag, published=run.published)
    version = -1
    last_step_ms = []
    # Steps' worth of tasks fed beyond the lag bound because the learner stalled: samples lost with a
    # killed service, or all dropped as stale (a generator restarted mid-step) leave it short of a step.
    extra, last_progress, intervals = 0, time.monotonic(), []
    flat = FlatGroups(s.max_policy_lag)
    cpu_first = cpu_last = None  # (version, CPU seconds by process) at the first and the latest version
    echo(f"[4/5] training: {s.groups_per_step} tasks x {recipe.sampling.group_size} samples per step, up to "
         f"{budget.steps} steps or {budget.minutes:g} minutes")
    try:
        async with bus.Producer(s) as producer:
            while version < budget.steps and time.monotonic() - started < budget.minutes * 60:
                run.check_services()
                # Stalled: much longer than steps take (never less than STALL_S) since the last version.
                stall_s = max(STALL_S, 3 * sorted(intervals)[len(intervals) // 2]) if intervals else 3 * STALL_S
                if time.monotonic() - last_progress > stall_s:
                    extra += 1
                    last_progress = time.monotonic()
                    echo(f"      no new policy version for {stall_s:.0f}s: feeding another step's tasks")
                # Keep the generator busy, within the lag bound (TaskFeed).
                feed.reached(version)
                for wanted in feed.due(extra=extra, filtered=flat.count,
                                       early=feeds_ahead(s.max_policy_lag, intervals[-20:])):
                    task = next(run.train_tasks)
                    task.min_policy_version = wanted
                    await producer.send("tasks", task, key=task.id)
                report.tasks_fed_early = feed.fed_early
                for incoming in await follower.fetch(timeout_ms=500):
                    pv = incoming.message
                    if pv.version <= version:
                        continue
                    if pv.created_at.ToDatetime(dt.timezone.utc).timestamp() < began:
                        version = pv.version  # a resumed run's earlier versions: where it stands, not progress
                        last_progress = time.monotonic()
                        continue
                    intervals.append(time.monotonic() - last_progress)
                    version, last_progress = pv.version, time.monotonic()
                    if version == 0:
                        continue
                    # From the first version to the last: the run in its stride, start-up left out. Taken
                    # then and every CPU_EVERY versions only, so the accounting costs the run next to nothing.
                    if cpu_first is None or version % CPU_EVERY == 0 or version >= budget.steps:
                        cpu_last = (version, await asyncio.to_thread(cpu_snapshot, run))
                        cpu_first = cpu_first or cpu_last
                        report.cpu_ms_per_step = cpu_per_step(cpu_first, cpu_last)
                    m = pv.metrics
                    elapsed = time.monotonic() - started
                    point = {"t": round(elapsed, 3), "version": version, "reward_mean": m.reward_mean,
                             "pass_rate": m.pass_rate, "kl": m.kl, "step_ms": m.step_ms}
                    last_step_ms.append(m.step_ms)
                    if version == 1:
                        report.train_pass_first = m.pass_rate
                    report.train_pass_last = m.pass_rate
                    report.curve.append(point)
                    echo(f"      step {version:4d}/{budget.steps}  reward {m.reward_mean:5.3f}  pass {m.pass_rate:5.3f}"
                         f"  kl {m.kl:6.4f}  stale {m.dropped_stale:3d}  filtered {m.skipped.get(UNINFORMATIVE, 0):3d}"
                         f"  {elapsed:6.1f}s")
                if s.dynamic_sampling:
                    # An observer of every sample: no consumer span each (32 a step, sampled, went to the store).
                    for incoming in await trajectories.fetch(timeout_ms=0, traced=False):
                        flat.add(incoming.message, version)
                for incoming in await evaluations.fetch(timeout_ms=0):
                    ev = incoming.message
                    report.evaluations.append({"t": round(time.monotonic() - started, 1), "version": ev.policy_version,
                                               "heldout": ev.pass_rate, "eval_ms": ev.eval_ms,
                                               **({"heldout_sampled": evaluation.sampled_rate(ev)}
                                                  if ev.samples else {})})
                    sampled = f", sampled {ev.samples_passed}/{ev.samples}" if ev.samples else ""
                    echo(f"      held-out pass rate {ev.pass_rate:.3f} at version {ev.policy_version} "
                         f"(evaluator, {ev.passed}/{ev.tasks}{sampled} in {ev.eval_ms / 1000:.1f}s)")
                for incoming in await alerts.fetch(timeout_ms=0):
                    a = incoming.message
                    severity = alert_pb2.Severity.Name(a.severity).removeprefix("SEVERITY_").lower()
                    report.alerts.append({"t": round(time.monotonic() - started, 1), "version": max(version, 0),
                                          "kind": a.kind, "severity": severity, "message": a.message})
                    echo(f"      ALERT {shown(a.kind)} ({severity}) at version {max(version, 0)}: {shown(a.message)}")
    finally:
        await follower.stop()
        await evaluations.stop()
        await alerts.stop()
        await trajectories.stop()
    report.steps = max(version, 0)
    report.seconds = time.monotonic() - started
    report.trajectories_per_s = (report.steps * s.groups_per_step * recipe.sampling.group_size
                                 / max(report.seconds, 1e-9))
    report.learner_step_ms = sorted(last_step_ms)[len(last_step_ms) // 2] if last_step_ms else 0.0
    if report.steps == 0:
        raise RuntimeError(f"no policy step within {budget.minutes:g} minutes; see the logs in {run.dir / 'logs'}")
