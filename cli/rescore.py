"""`crucible rescore`: a run's stored samples graded again by the current verifier, generating nothing.

Once a hack is found and the verifier fixed, the run's rollouts need not be sampled again: every
stored sample of the run (`trajectories`, with its task from the `tasks` log) goes back through the
Verifier service (which runs the sandbox where the kind needs it), and the new verdict is stored in
`rescores` beside the reward the sample was trained on, with the verifier's version. The report
says how many rewards changed, in which direction, and on which tasks.

`--grade-as OLD=NEW` grades the tasks of kind OLD with kind NEW instead: how a run graded by a
kind now known to be weak (the planted `lenient_exact`) is compared with the strict one (`exact`).
Multi-turn episodes are not rescored yet (their tool calls would have to be replayed); they are
counted and named in the report.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from google.protobuf import json_format

from crucible.ml import evaluation
from crucible.shared import bus, integrity, rpc, store
from crucible.shared.settings import Settings
from crucible.shared.text import shown
from crucible.v1 import rollout_pb2, task_pb2, verdict_pb2

COLUMNS = ["rescore_id", "run_id", "trajectory_id", "task_id", "task_kind", "graded_as", "policy_version",
           "verifier_version", "old_reward", "new_reward", "old_components", "new_components", "passed",
           "tampered", "detail", "ts"]
CHANGED = 1e-9  # rewards further apart than this changed


class RescoreError(ValueError):
    """Nothing to rescore, or a request that cannot be carried out; the text says why."""


@dataclass
class RescoreReport:
    rescore_id: str
    run_id: str
    verifier_version: str = ""
    samples: int = 0
    rescored: int = 0
    raised: int = 0
    lowered: int = 0
    old_reward: float = 0.0  # the sum over rescored samples
    new_reward: float = 0.0
    episodes_skipped: int = 0
    tasks_missing: int = 0
    tasks_unreadable: int = 0
    tasks_unsigned: int = 0
    failed: int = 0
    changed_by_task: Counter = field(default_factory=Counter)

    @property
    def changed(self) -> int:
        return self.raised + self.lowered


def parse_grade_as(items: list[str]) -> dict[str, str]:
    """{OLD: NEW} from ["OLD=NEW", ...]; each kind named must be registered."""
    from crucible.ml import kinds

    mapping = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise RescoreError(f"--grade-as wants OLD=NEW (two task kinds), got {item!r}")
        if new not in kinds.known():
            raise RescoreError(f"--grade-as {item}: {new!r} is not a task kind; kinds are {sorted(kinds.known())}")
        mapping[old] = new
    return mapping


def row(rescore_id: str, run_id: str, sample: tuple, graded_as: str, verdict: verdict_pb2.Verdict) -> list:
    """A row of `rescores` (COLUMNS): a stored sample (as `stored_samples` reads it) and its new verdict."""
    trajectory_id, task_id, kind, version, _, old_reward, old_components, _ = sample
    return [rescore_id, run_id, trajectory_id, task_id, kind, graded_as, version, verdict.verifier_version,
            old_reward, 0.0 if verdict.tampered else verdict.reward, dict(old_components), dict(verdict.components),
            int(verdict.sample.passed), int(verdict.tampered), verdict.detail[:500], dt.datetime.now(dt.timezone.utc)]


def newest_run(client) -> str:
    rows = client.query("SELECT run_id FROM trajectories WHERE run_id != '' "
                        "ORDER BY created_at DESC LIMIT 1").result_rows
    if not rows:
        raise RescoreError("the store holds no samples of any run (runs store them from `crucible train` on)")
    return rows[0][0]


def stored_samples(client, run_id: str) -> tuple[list[tuple], dict[str, str]]:
    """(the run's samples: (id, task id, kind, version, completion, reward, components, turns),
    {task id: the task as JSON})."""
    samples = client.query(
        "SELECT trajectory_id, task_id, task_kind, policy_version, completion, reward, reward_components, turns "
        "FROM trajectories FINAL WHERE run_id = {r:String} ORDER BY created_at", parameters={"r": run_id}).result_rows
    tasks = dict(client.query(
        f"SELECT task_id, argMax(task_json, recorded_at) FROM {store.TASKS_TABLE} WHERE run_id = {{r:String}} "
        "AND task_json != '' "
        "GROUP BY task_id", parameters={"r": run_id}).result_rows)
    return samples, tasks


async def rescore(settings: Settings, *, run_id: str | None, grade_as: dict[str, str], verify,
                  verifier_settings: Settings | None = None, concurrency: int = 8, echo=print) -> RescoreReport:
    """Grades the run's stored samples again through `verify` and stores the new verdicts. A stored task
    is taken only as the run signed it (the task log is a table anyone reaching the store may write),
    and is signed anew for the verifier's run (`verifier_settings`; default: `settings`)."""
    client = await asyncio.to_thread(store.connect, settings, create_database=False)
    await asyncio.to_thread(store.migrate, client)
    run_id = run_id or await asyncio.to_thread(newest_run, client)
    samples, tasks = await asyncio.to_thread(stored_samples, client, run_id)
    if not samples:
        raise RescoreError(f"run {run_id!r} has no stored samples")
    report = RescoreReport(rescore_id=f"rescore-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}-"
                                      f"{uuid.uuid4().hex[:6]}", run_id=run_id, samples=len(samples))
    echo(f"rescoring {len(samples)} samples of run {shown(run_id)}"
         + (f", grading {', '.join(f'{a} as {b}' for a, b in grade_as.items())}" if grade_as else ""))
    slots = asyncio.Semaphore(concurrency)
    rows: list[list] = []
    signed_by_run = integrity.key(settings.model_copy(update={"run_id": run_id}))
    secret = integrity.key(verifier_settings or settings)

    async def one(sample: tuple) -> None:
        trajectory_id, task_id, kind, version, completion, old_reward, old_components, turns = sample
        if turns:
            report.episodes_skipped += 1
            return
        if task_id not in tasks:
            report.tasks_missing += 1
            return
        try:  # stored by another version of Crucible, or damaged: that sample, never the whole rescore
            task = json_format.Parse(tasks[task_id], task_pb2.Task())
        except (json_format.ParseError, ValueError, RecursionError):
            report.tasks_unreadable += 1
            return
        if task.id != task_id or not integrity.signed_correctly(task, signed_by_run):  # (another task of the run's,
            report.tasks_unsigned += 1                                                # stored under this id)
            return
        graded_as = grade_as.get(task.kind, task.kind)
        task.kind = graded_as  # regraded on purpose, by a process holding the key
        integrity.sign_task(task, secret)
        request = verdict_pb2.VerifyRequest(task=task, rollout=rollout_pb2.Rollout(
            id=trajectory_id, completion=completion))
        async with slots:
            try:
                verdict = await verify(request)
            except Exception as exc:  # one sample the verifier cannot take: counted, the rest go on
                report.failed += 1
                if report.failed <= 3:
                    echo(f"      {shown(trajectory_id)}: the verifier refused it: {shown(exc)}")
                return
        new_reward = verdict.reward if not verdict.tampered else 0.0
        report.rescored += 1
        report.verifier_version = verdict.verifier_version
        report.old_reward += old_reward
        report.new_reward += new_reward
        if new_reward > old_reward + CHANGED:
            report.raised += 1
        elif new_reward < old_reward - CHANGED:
            report.lowered += 1
        if abs(new_reward - old_reward) > CHANGED:
            report.changed_by_task[task_id] += 1
        rows.append(row(report.rescore_id, run_id, sample, graded_as, verdict))
        if report.rescored % 500 == 0:
            echo(f"      {report.rescored}/{len(samples)} rescored, {report.changed} rewards changed so far")

    await asyncio.gather(*(one(s) for s in samples))
    for start in range(0, len(rows), 5000):
        await asyncio.to_thread(client.insert, "rescores", rows[start:start + 5000], column_names=COLUMNS)
    return report


@contextlib.asynccontextmanager
async def local_verifier(settings: Settings, echo=print) -> AsyncIterator[tuple[evaluation.Verify, Settings]]:
    """A Verifier service (and the sandbox it runs code in) started for this command and stopped after:
    (its Verify, the settings of its run, whose key the tasks it is given must be signed with)."""
    from crucible.cli.recipe import builtin
    from crucible.cli.train import Run, run_prefixes

    run = Run(settings, builtin(), echo=echo, name="rescore")
    run.start_services("", names=("sandbox_executor", "verifier"))
    try:
        await _wait_ready(run)
        async with evaluation.verifier(run.verifier_address) as verify:
            yield verify, run.settings
    finally:
        run.stop_services()
        with contextlib.suppress(Exception):  # the verifier's topics, unused here: a broker gone keeps them
            await bus.delete_topics(run_prefixes(run.run_id), settings=run.settings)


async def _wait_ready(run, timeout_s: float = 60.0) -> None:
    """Until the verifier (and its sandbox) report SERVING, or RescoreError naming the logs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for address, service in ((run.sandbox_address, "crucible.v1.Sandbox"), (run.verifier_address, "crucible.v1.Verifier")):
        while True:
            run.check_services()
            try:
                if await rpc.health_status(address, service, timeout=1.0) == "SERVING":
                    break
            except Exception:
                pass
            if loop.time() > deadline:
                raise RescoreError(f"the {service} started for rescoring did not answer in {timeout_s:.0f}s "
                                   f"(logs in {run.dir / 'logs'})")
            await asyncio.sleep(0.3)


def summary(report: RescoreReport, top: int = 10) -> list[str]:
    """The report's lines; its run, verifier version and task ids are stored text, each `shown`."""
    lines = [f"rescore {report.rescore_id} of run {shown(report.run_id)} "
             f"(verifier {shown(report.verifier_version or '-')}):",
             f"  samples rescored : {report.rescored} of {report.samples}",
             f"  rewards changed  : {report.changed} ({report.raised} up, {report.lowered} down) "
             f"on {len(report.changed_by_task)} tasks",
             f"  mean reward      : {report.old_reward / max(report.rescored, 1):.3f} as trained -> "
             f"{report.new_reward / max(report.rescored, 1):.3f} now"]
    if report.episodes_skipped:
        lines.append(f"  not rescored     : {report.episodes_skipped} multi-turn episodes (replaying their tool "
                     "calls is not supported yet)")
    if report.tasks_missing:
        lines.append(f"  not rescored     : {report.tasks_missing} samples whose task the store does not hold "
                     "(runs record tasks through the control service)")
    if report.tasks_unreadable:
        lines.append(f"  not rescored     : {report.tasks_unreadable} samples whose stored task does not read as a "
                     "task of this version of Crucible")
    if report.tasks_unsigned:
        lines.append(f"  not rescored     : {report.tasks_unsigned} samples whose stored task the run did not sign as "
                     "theirs (written to the store by someone else, or by a Crucible before run keys)")
    if report.failed:
        lines.append(f"  not rescored     : {report.failed} samples the verifier refused")
    for task_id, n in report.changed_by_task.most_common(top):
        lines.append(f"    {n:4d} changed  {shown(task_id)}")
    lines.append(f"  compare: crucible query rescore --rescore {report.rescore_id}")
    return lines
