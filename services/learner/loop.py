"""The learner's loop: read samples, step on whole groups, checkpoint, publish, record, commit.

Positions on crucible.trajectories are saved in each checkpoint with the weights they produced;
a restarted learner seeks back to them (the bus Reader's assign + seek), and skips the samples it
trained on past them, so no sample is trained on twice and none is lost.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import pickle
import time
from collections import Counter, deque
from pathlib import Path

from safetensors import SafetensorError

from crucible.ml import evaluation
from crucible.ml.policy import transfer
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint, path_from_uri, save_checkpoint
from crucible.services.learner import checkpoints
from crucible.services.learner.groups import Buffered, GroupBuffer, informative, sample_problem
from crucible.services.learner.monitors import HealthMonitor
from crucible.services.learner.reference import ReferenceAhead
from crucible.services.learner.ranks import IDLE_BEAT_S, Ranks
from crucible.services.learner.rows import record_alert, record_steps, step_entry
from crucible.services.learner.trainer import StepResult, Trainer
from opentelemetry.metrics import Observation

from crucible.shared import bus, integrity, metrics, telemetry
from crucible.shared.settings import Settings, shown_url
from crucible.v1 import policy_pb2

log = logging.getLogger("crucible.learner")

# What the last step measured, read by the gauges when scraped; the step time as a histogram.
_last_step: dict[str, float] = {}
STEP_MS = metrics.histogram("crucible.learner.step.duration", "time of one policy step", "ms")
GAUGED = ("kl", "entropy", "grad_norm", "loss", "reward_mean", "pass_rate", "mismatch_kl", "response_length",
          "samples", "learning_rate", "policy_lag", "policy_lag_max", "filtered_groups", "checkpoint_ms", "publish_ms")


def _step_gauges(options):
    for name in GAUGED:
        if name in _last_step:
            yield Observation(_last_step[name], {"measure": name})


STEP_GAUGE = metrics.gauge("crucible.learner.step", _step_gauges, "the last policy step's measures (by `measure`)")


def observe_step(values: dict) -> None:
    _last_step.update({k: float(v) for k, v in values.items() if isinstance(v, (int, float))})
    if "step_ms" in values:
        STEP_MS.record(float(values["step_ms"]))

TOPIC = "trajectories"
# A step's rows (train_steps, policy_versions) wait for the next steps' at most this long and go to the
# store with them: each insert is a part the store writes and later merges, 5-7 ms of its CPU however
# few its rows, and a step every quarter second made that two inserts a step. The rows not yet written
# ride in every checkpoint (step_records), so a learner killed first writes them when it starts.
ROWS_EVERY_S = 1.0


def build_trainer(settings: Settings, ranks: Ranks | None = None) -> tuple[Trainer, dict]:
    """Resumes from the run's newest checkpoint, or starts from the initial weights (version 0).
    Every rank calls it; rank 0 chooses the checkpoint (and writes version 0's), the others follow."""
    ranks = ranks or Ranks()
    config = settings.run_config()
    loaded = _newest_loadable(settings) if ranks.main else None
    found = ranks.broadcast(loaded and loaded[0])
    if found is not None:
        model, meta, optimizer_state = loaded[1] if ranks.main else checkpoints.load(found)
        reference, _ = load_checkpoint(path_from_uri(meta["reference_uri"]))
        trainer = Trainer(model, config, reference=reference, version=meta["version"], step=meta["step"],
                          optimizer_state=optimizer_state, ranks=ranks)
        log.info("resumed run %s at version %d (step %d) from %s", settings.run_id, trainer.version,
                 trainer.step_count, found)
        newest = ranks.broadcast(checkpoints.newest_number(settings) if ranks.main else None)
        if newest > trainer.version:
            # A later version was written (and may have been announced: generators holding it take only a
            # later number), and passed over: the weights resumed are written again as the version after it,
            # which is then the version announced, and the one a later restart resumes at.
            trainer.version = newest + 1
            checkpoints.save(settings, trainer, {int(p): o for p, o in meta["offsets"].items()},
                             meta.get("trained_ids_past_offsets", []), meta["reference_uri"],
                             meta.get("step_records"), meta.get("recent_trained_ids"))
            log.warning("resumed the weights of version %d as version %d (versions up to %d were passed over)",
                        meta["version"], trainer.version, newest)
            meta = {**meta, "version": trainer.version}
        return trainer, meta
    if settings.init_checkpoint:
        model, _ = load_checkpoint(path_from_uri(settings.init_checkpoint))
        reference_uri = path_from_uri(settings.init_checkpoint).resolve().as_uri()
    else:
        model = fresh_policy(settings.seed)
        reference_uri = ranks.broadcast(save_checkpoint(model, checkpoints.run_dir(settings) / "reference",
                                                        {"version": 0}).as_uri() if ranks.main else None)
    trainer = Trainer(model, config, ranks=ranks)
    meta = {"offsets": {}, "trained_ids_past_offsets": [], "reference_uri": reference_uri}
    checkpoints.save(settings, trainer, {}, [], reference_uri)
    return trainer, meta


# What a checkpoint's damaged files raise as they load (safetensors' header or data cut short, a cut-off zip
# of optimiser state, JSON cut short); anything else (memory, a missing package) is no reason to pass a
# version over.
DAMAGED = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError)


def _newest_loadable(settings: Settings) -> tuple[Path, tuple] | None:
    """The newest version that loads, and what it loads to (checkpoints.load); what failed writes left is
    removed. A version whose files are damaged (cut short by a crash or a full disk) is passed over, with
    an error logged, for the one before: it stopped every restart of the learner, however sound the one
    before. Where none loads, the newest one's error is raised (never a fresh start)."""
    cleared = checkpoints.clear_unfinished(settings)
    if cleared:
        log.warning("removed what unfinished checkpoint writes left: %s", ", ".join(cleared))
    first = None
    for found in checkpoints.newest_first(settings):
        try:
            return found, checkpoints.load(found)
        except DAMAGED as exc:
            log.error("checkpoint %s does not load, passed over for the version before: %s: %s", found,
                      type(exc).__name__, str(exc)[:300])
            first = first or exc
    if first is not None:
        raise first
    return None


def announced_uri(settings: Settings, folder) -> str:
    """Where the PolicyVersion for the checkpoint folder points: the folder, or with checkpoint_base_uri
    set, its copy under base/<run_id>/ (policy_message makes it)."""
    if settings.checkpoint_base_uri:
        return transfer.join(settings.checkpoint_base_uri, settings.run_id, transfer.local_path(folder).name)
    return transfer.local_path(folder).absolute().as_uri()


def policy_message(settings: Settings, version: int, step: int, uri: str, result: StepResult | None
                   ) -> policy_pb2.PolicyVersion:
    """The PolicyVersion announcing the checkpoint folder at `uri`, with the folder's content hash; with
    checkpoint_base_uri set, the folder is first copied to base/<run_id>/ and the message names the copy.
    Reads the folder (and may upload it): off the event loop when that takes long."""
    folder = transfer.local_path(uri)
    sha256 = transfer.content_hash(folder)
    if settings.checkpoint_base_uri:
        base = transfer.join(settings.checkpoint_base_uri, settings.run_id)
        uri = transfer.publish(folder, base, settings.checkpoint_storage_options)
        # Copies older than every version the learner keeps (checkpoints.prune) go there too; best effort:
        # storage that lets the learner write but not delete must not stop it.
        kept = checkpoints.newest_first(settings)
        try:
            transfer.prune(base, transfer.version_number(kept[-1].name) if kept else 0,
                           settings.checkpoint_storage_options)
        except Exception as exc:  # noqa: BLE001 -- whatever the storage says
            log.warning("old checkpoint copies under %s were not removed: %s: %s", shown_url(base),
                        type(exc).__name__, str(exc)[:300])
    pv = policy_pb2.PolicyVersion(run_id=settings.run_id, version=version, checkpoint_uri=uri, step=step,
                                  checkpoint_sha256=sha256)
    if result is not None:
        fields = policy_pb2.StepMetrics.DESCRIPTOR.fields_by_name
        pv.metrics.CopyFrom(policy_pb2.StepMetrics(
            **{k: v for k, v in result.metrics.items() if k in fields and k != "skipped"},
            skipped=dict(result.skipped)))
    pv.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return pv


class RecentIds:
    """The ids of the samples the last steps trained on: the last `min_steps` steps' at least (a replay of
    a sample is refused by its id for as long as it is fresh enough to be trained on: the learner makes
    them max_policy_lag + 2), otherwise at most MAX_IDS ids. Every sample of a policy version from
    `horizon` on that was trained on is remembered: with no staleness bound (max_policy_lag -1), one of
    an older version may have been trained on in a step forgotten, and a replay cannot be told from it."""

    MIN_STEPS, MAX_IDS = 4, 8192  # replays come within seconds of a restart; the ids ride in every checkpoint

    def __init__(self, saved: dict | list, min_steps: int = MIN_STEPS):
        if isinstance(saved, dict):
            steps, versions, self.horizon = saved.get("steps", []), saved.get("versions", []), saved.get("horizon", 0)
        else:  # a checkpoint of a learner that kept the ids alone
            steps, versions, self.horizon = saved, [], 0
        if len(versions) != len(steps):
            versions = [None] * len(steps)
        self.min_steps = max(self.MIN_STEPS, min_steps)
        self._steps: deque[tuple[int | None, list[str]]] = deque(zip(versions, steps))
        self._ids = {i for step in steps for i in step}

    @classmethod
    def for_lag(cls, saved: dict | list, max_policy_lag: int) -> "RecentIds":
        """As a learner whose samples may lag `max_policy_lag` versions behind keeps them."""
        return cls(saved, min_steps=max_policy_lag + 2 if max_policy_lag >= 0 else 0)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._ids

    def add(self, ids: list[str], version: int) -> None:
        """The ids a step trained on; `version`: the one it made (every sample it trained is older)."""
        self._steps.append((version, ids))
        self._ids.update(ids)
        while len(self._steps) > self.min_steps and len(self._ids) > self.MAX_IDS:
            forgotten, old = self._steps.popleft()
            self._ids.difference_update(old)
            if forgotten is not None:
                self.horizon = max(self.horizon, forgotten)

    def saved(self) -> dict:
        return {"steps": [ids for _, ids in self._steps], "versions": [v for v, _ in self._steps],
                "horizon": self.horizon}


class Learner:
    def __init__(self, settings: Settings, store_client, producer: bus.Producer, trainer: Trainer, meta: dict,
                 on_publish=None):
        self.settings = settings
        self.secret = integrity.key(settings)  # trajectories are the aggregator's, signed with it
        self.store = store_client
        self.producer = producer
        self.trainer = trainer
        self.reference_uri = meta["reference_uri"]
        # Steps whose rows are not in the store yet (rows.step_entry), oldest first; the checkpoint's own
        # (a learner killed before writing them) to begin with. `unrecorded_since`: when the oldest came.
        self.unrecorded: list[dict] = list(meta.get("step_records") or [])
        self.unrecorded_since = time.monotonic()
        self.topic = settings.topic(TOPIC)
        saved = {int(p): o for p, o in meta.get("offsets", {}).items()}
        self.reader = bus.Reader([TOPIC], settings.consumer_group_prefix + "learner", settings=settings,
                                 producer=producer, offsets={TOPIC: saved})
        # Samples trained on that sit past the saved positions (a restart re-reads them): id -> (partition, offset).
        self.trained_past: dict[str, tuple[int, int]] = {}
        # The ids each recent step trained on: a sample published again (the aggregator delivers at least
        # once, and replays what it had not committed when it stopped) is not trained on twice...
        self.recent = RecentIds.for_lag(meta.get("recent_trained_ids", []), settings.max_policy_lag)
        # ...and those the checkpoint names without their offsets, until the reader has caught up with
        # what was published before this start (they are all behind that).
        self.restored: set[str] = set(meta.get("trained_ids_past_offsets", []))
        # Held-out pass rates from the evaluator, for the health monitor (reward rising, held-out not).
        self.evaluations = bus.Reader(["evaluations"], None, settings=settings, producer=producer,
                                      offsets={"evaluations": {}}, dead_letters=False,
                                      trusted=True)
        self.buffer = GroupBuffer()
        self.training: set[str] = set()  # the ids of the samples the step under way trains on
        self.ahead = ReferenceAhead(trainer)  # whole groups read through the reference as they arrive
        self.uninformative: list[list[Buffered]] = []  # filtered by dynamic sampling, counted with the next step
        self.duplicates = 0  # samples not buffered because they were trained on already
        self.monitor = HealthMonitor(settings.run_id, kl_limit=settings.detect_kl_limit,
                                     entropy_floor=settings.detect_entropy_floor,
                                     reward_gain=settings.detect_reward_gain,
                                     length_factor=settings.detect_length_factor)
        self.on_publish = on_publish or (lambda pv: None)
        self.tracer = telemetry.tracer("crucible.learner")
        self.beat = time.monotonic()  # when the other ranks last heard from this one
        # The last version's hand-over (announce, record, commit), which runs while the next step trains.
        self.handing_over: asyncio.Future | None = None

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            await asyncio.to_thread(self.ahead.close)
        # Stopped as asked: the other ranks (if any) stop too. After a failure (a rank died) they learn it from
        # the broken collective instead.
        try:
            await asyncio.to_thread(self.trainer.release)
        except Exception as exc:  # a rank gone already (its launcher stops them all): nothing to tell it
            log.warning("could not tell the other learner ranks to stop: %s", exc)

    async def _run(self, stop: asyncio.Event) -> None:
        async with self.reader, self.evaluations:
            start_uri = checkpoints.version_dir(self.settings, self.trainer.version).as_uri()
            # Hashing (and uploading, with a remote checkpoint base) takes a while: off the event loop.
            record = next((e for e in self.unrecorded if e["version"] == self.trainer.version), None)
            last = StepResult(True, record["metrics"], Counter(record["skipped"])) if record else None
            pv = await asyncio.to_thread(policy_message, self.settings, self.trainer.version,
                                         self.trainer.step_count, start_uri, last)
            await self._publish(pv)
            await self._record(due=True)  # killed after its checkpoint: its steps' rows may not be in yet
            log.info("learner ready: run %s, version %d, %d groups per step, objective %s", self.settings.run_id,
                     self.trainer.version, self.settings.groups_per_step, self.settings.objective)
            while not stop.is_set():
                if self.handing_over is not None and self.handing_over.done():
                    await self._handed_over()  # a hand-over that failed stops the service now, not at the next step
                for incoming in await self.evaluations.fetch(timeout_ms=0):
                    ev = incoming.message
                    if ev.run_id == self.settings.run_id and ev.tasks:
                        # the sampled rate, drawn as the training reward is, where the evaluator gave one
                        sampled = evaluation.sampled_rate(ev)
                        self.monitor.record_heldout(int(ev.policy_version),
                                                    ev.pass_rate if sampled is None else sampled)
                fetched = await self.reader.fetch(max_records=500)
                if self.restored and not fetched and await self.reader.at_end():
                    self.restored.clear()
                await self._take_in(fetched)
                while (batch := self._next_batch()) is not None:
                    await self._step(*batch)
                    self.beat = time.monotonic()
                if time.monotonic() - self.beat > IDLE_BEAT_S:
                    await asyncio.to_thread(self.trainer.keepalive)
                    self.beat = time.monotonic()
                if self.handing_over is None and self._rows_due():  # no step came to take them along
                    self.handing_over = asyncio.ensure_future(self._record())
            await self._handed_over()  # the last version announced, recorded and committed before the reader closes
            await self._record(due=True)

    async def _take_in(self, fetched: list[bus.Incoming]) -> None:
        """Buffers the fetched samples that are the aggregator's, fit the model, and were not trained on
        (nor are being trained on now); the others are dead-lettered or counted as duplicates. The
        groups they complete start their reference pass."""
        for incoming in fetched:
            problem = None if integrity.signed_correctly(incoming.message, self.secret) else (
                f"trajectory {incoming.message.id[:200]!r} is not signed by a reward aggregator of this "
                f"run (unsigned, or signed with {integrity.ANOTHER_KEY}): only the aggregator sets rewards and advantages")
            signed = problem is None
            problem = problem or sample_problem(incoming.message, self.trainer.vocab_size, self.trainer.max_positions,
                                                 self.trainer.version)
            if not problem and self.settings.max_policy_lag < 0 and incoming.message.policy_version < self.recent.horizon:
                problem = (f"sampled at version {incoming.message.policy_version}, older than every step the learner "
                           f"remembers training on (from version {self.recent.horizon}): with no staleness bound, a "
                           "replay of a sample trained on cannot be told from it")
            if problem:
                await self.reader.reject(incoming, problem)
                if signed:  # the aggregator's: its group will not see it again
                    self.buffer.refuse(incoming.message)
                continue
            sample_id = incoming.message.id
            if sample_id in self.trained_past or sample_id in self.recent or sample_id in self.restored \
                    or sample_id in self.training:
                self.duplicates += 1  # trained on already: read again after a restart, or published twice
                continue
            self.buffer.add(Buffered(incoming.message, incoming.topic, incoming.partition,
                                     incoming.offset, incoming.context))
        if fetched:
            self._read_ahead()

    async def _take_in_until(self, stepping: asyncio.Future) -> None:
        """Takes in what arrives while a step trains, until it ends. The next step's groups arrive then
        (the generator samples a version ahead): their reference pass runs beside this step, as
        ReferenceAhead means it to. Taken in only between steps, it began once this step had ended, and
        the next step waited for it (its span 371 ms at the median against its own 246)."""
        while not stepping.done():
            arrival = asyncio.ensure_future(self.reader.records_ready())
            try:
                await asyncio.wait({stepping, arrival}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrival.cancel()
            if not stepping.done():
                await self._take_in(await self.reader.fetch(max_records=500, timeout_ms=0))

    def _read_ahead(self) -> None:
        """Whole groups a step may train on go through the reference now, beside the step before
        (reference.py); those dynamic sampling will filter, or too stale to train on, do not."""
        for group_id in self.buffer.ready():
            samples = [m.sample for m in self.buffer.groups[group_id]]
            if (not self.settings.dynamic_sampling or informative(samples)) and \
                    any(self.trainer.fresh_enough(s) for s in samples):
                self.ahead.submit(group_id, samples)

    def _next_batch(self) -> tuple[list[list[Buffered]], list[list[Buffered]]] | None:
        """The next step's groups to train on and the uninformative ones it filtered, once there are
        enough; None until then. Without dynamic sampling every whole group counts.

        With it, uninformative groups (all rewards equal, or all samples too stale to train on) leave
        the buffer as they complete and wait here; a step takes groups_per_step informative groups
        (stale ones are counted as such), or, once dynamic_sampling_window times
        that many groups have arrived since the last step, the informative ones there are (none:
        groups_per_step uninformative ones, so a solved task set still advances).
        """
        per_step = self.settings.groups_per_step
        ready = self.buffer.ready()
        if not self.settings.dynamic_sampling:
            return (self.buffer.take(ready[:per_step]), []) if len(ready) >= per_step else None
        flat = {g for g in ready if not informative([m.sample for m in self.buffer.groups[g]])
                or not any(self.trainer.fresh_enough(m.sample) for m in self.buffer.groups[g])}
        self.uninformative += self.buffer.take([g for g in ready if g in flat])
        useful = [g for g in ready if g not in flat]
        if len(useful) >= per_step:
            chosen = self.buffer.take(useful[:per_step])
        elif len(useful) + len(self.uninformative) >= self.settings.dynamic_sampling_window * per_step:
            chosen = self.buffer.take(useful) if useful else self.uninformative[:per_step]
            if not useful:
                self.uninformative = self.uninformative[per_step:]
        else:
            return None
        filtered, self.uninformative = self.uninformative, []
        return chosen, filtered

    async def _step(self, groups: list[list[Buffered]], filtered: list[list[Buffered]] = ()) -> None:
        """One optimiser step on `groups`; the `filtered` ones (uninformative) are counted with it."""
        trainer = self.trainer
        groups = list(groups) + list(filtered)
        flat = frozenset(g[0].sample.group_id for g in filtered)
        # The step joins the trace of every task it trains on: one span per group, child of that
        # group's consumer span, all covering the same optimiser step.
        spans = [self.tracer.start_span("learner step", context=g[0].context) for g in groups]
        try:
            ids = [g[0].sample.group_id for g in groups]
            self.training = {m.sample.id for g in groups for m in g}
            stepping = asyncio.ensure_future(asyncio.to_thread(
                lambda: trainer.step([m.sample for g in groups for m in g], flat, self.ahead.take(ids))))
            await self._take_in_until(stepping)
            result = await stepping
            for span in spans:
                span.set_attribute("crucible.learner.version", trainer.version)
                span.set_attribute("crucible.learner.stepped", result.stepped)
        finally:
            for span in spans:
                span.end()
        # The previous version's hand-over has long ended (it had this whole step): waiting for it keeps
        # versions announced and positions committed in order, with at most one hand-over under way.
        await self._handed_over()
        taken = [m for g in groups for m in g]
        positions = self.buffer.resume_positions(self.reader.positions)
        if not result.stepped:
            # No optimiser step, no version: the samples are accounted for (skipped, by reason) and
            # committed; the checkpoint keeps its older positions, so a restart only re-reads them to skip them again.
            log.info("no optimiser step on %d samples (skipped: %s)", len(taken), dict(result.skipped))
            self.training = set()
            await self.reader.commit(positions)
            return
        self.trained_past.update({m.sample.id: (m.partition, m.offset) for m in taken})
        self.trained_past = {i: (p, o) for i, (p, o) in self.trained_past.items()
                             if o >= positions.get((self.topic, p), 0)}
        samples = [m.sample.id for m in taken]
        self.recent.add(samples, trainer.version)
        self.training = set()  # recent holds them now
        if not self.unrecorded:
            self.unrecorded_since = time.monotonic()
        entry = step_entry(trainer.version, trainer.step_count,
                           announced_uri(self.settings, checkpoints.version_dir(self.settings, trainer.version)),
                           result.metrics, result.skipped, samples)
        self.unrecorded.append(entry)
        began = time.perf_counter()
        # The version's state copied before the next step changes the model (checkpoints.capture); writing
        # it, hashing the folder, announcing it, the steps' rows and alerts and the commit (the hand-over)
        # run while the next step trains. Where it cannot be copied so, it is written here first.
        captured = await asyncio.to_thread(checkpoints.capture, trainer)
        write = functools.partial(checkpoints.save, self.settings, trainer,
                                  {p: o for (t, p), o in positions.items() if t == self.topic},
                                  sorted({*self.trained_past, *self.restored}), self.reference_uri,
                                  list(self.unrecorded), self.recent.saved(), captured)
        folder = write if captured is not None else await asyncio.to_thread(write)
        result.metrics["checkpoint_ms"] = (time.perf_counter() - began) * 1000
        self.handing_over = asyncio.ensure_future(self._hand_over(
            trainer.version, trainer.step_count, folder, result, entry, positions))

    async def _handed_over(self) -> None:
        """Waits for the last hand-over to end (raising what it raised)."""
        if self.handing_over is not None:
            handing_over, self.handing_over = self.handing_over, None
            await handing_over

    async def _hand_over(self, version: int, step: int, folder, result: StepResult, entry: dict,
                         positions: dict) -> None:
        """A checkpointed version announced (crucible.policy), its step recorded (alerts; rows once
        due), and the positions it trained up to committed; `folder` is the checkpoint's, or the call that
        writes it (a captured state, written here: publish_ms counts it, checkpoint_ms what the step's path
        spent). A learner stopped before this ends resumes from its newest checkpoint, announces it again
        when it starts and writes the rows that checkpoint lists (`_run`); positions not committed are read
        again, and skipped where the checkpoint names what they trained."""
        began = time.perf_counter()
        if callable(folder):
            folder = await asyncio.to_thread(folder)
        pv = await asyncio.to_thread(policy_message, self.settings, version, step, folder.as_uri(), result)
        await self._publish(pv)
        # The step's own time is step_ms; what it costs to hand the version over comes after it.
        result.metrics["publish_ms"] = (time.perf_counter() - began) * 1000
        observe_step(result.metrics)
        entry["metrics"].update(checkpoint_ms=result.metrics["checkpoint_ms"], publish_ms=result.metrics["publish_ms"])
        await self._record()
        for alert in self.monitor.check(step, version, result.metrics):
            log.warning("alert %s: %s", alert.kind, alert.message)
            await self.producer.send_and_wait("alerts", alert, key=alert.kind)
            await asyncio.to_thread(record_alert, self.store, alert)
        await self.reader.commit(positions)
        m = result.metrics
        log.info("step %d -> version %d: reward %.3f pass %.3f loss %.4f kl %.4f mismatch-kl %.2e (%d samples, "
                 "skipped %s, %.0f ms; %d duplicates not trained again so far)", step, version,
                 m["reward_mean"], m["pass_rate"], m["loss"], m["kl"], m.get("mismatch_kl", 0.0), m["samples"],
                 dict(result.skipped), m["step_ms"], self.duplicates)

    def _rows_due(self) -> bool:
        return bool(self.unrecorded) and time.monotonic() - self.unrecorded_since >= ROWS_EVERY_S

    async def _record(self, due: bool = False) -> None:
        """Writes the rows of the steps not recorded yet, once the oldest has waited ROWS_EVERY_S (or
        `due`). Runs as a hand-over runs (one at a time): a failed insert stops the service, and its
        restart writes the rows its checkpoint lists."""
        if self.unrecorded and (due or self._rows_due()):
            entries = list(self.unrecorded)
            await asyncio.to_thread(record_steps, self.store, self.settings.run_id, entries)
            del self.unrecorded[:len(entries)]

    async def _publish(self, pv: policy_pb2.PolicyVersion) -> None:
        await self.producer.send_and_wait("policy", pv, key=self.settings.run_id)
        self.on_publish(pv)
