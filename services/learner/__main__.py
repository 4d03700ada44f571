"""python -m crucible.services.learner: crucible.trajectories -> policy steps -> checkpoints + crucible.policy + ClickHouse."""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import OrderedDict

from aiokafka import AIOKafkaConsumer, TopicPartition

from crucible.v1 import policy_pb2, policy_pb2_grpc, trajectory_pb2
from crucible.services.learner import checkpoints
from crucible.services.learner.monitors import HealthMonitor
from crucible.services.learner.servicer import LearnerServicer
from crucible.services.learner.trainer import Hyperparameters, Trainer
from crucible.shared import bus, messages, rpc, service, store, telemetry
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint, path_from_uri, save_checkpoint
from crucible.shared.settings import Settings

log = logging.getLogger("crucible.learner")

TRAIN_STEP_COLUMNS = ["run_id", "step", "policy_version", "loss", "kl", "entropy", "grad_norm", "reward_mean",
                      "pass_rate", "lr", "step_time_ms", "ts"]


def hyperparameters(settings: Settings) -> Hyperparameters:
    return Hyperparameters(objective=settings.learner_objective, lr=settings.learner_lr,
                           clip_eps=settings.learner_clip_eps, kl_coef=settings.learner_kl_coef,
                           entropy_coef=settings.learner_entropy_coef, max_grad_norm=settings.learner_max_grad_norm,
                           dpo_beta=settings.learner_dpo_beta, max_policy_lag=settings.max_policy_lag,
                           epochs=settings.learner_epochs, lr_decay_steps=settings.learner_lr_decay_steps)


def build_trainer(settings: Settings) -> tuple[Trainer, dict]:
    """Resumes from the run's newest checkpoint, or starts from the initial weights (version 0)."""
    hp = hyperparameters(settings)
    found = checkpoints.latest(settings)
    if found is not None:
        model, meta, optimizer_state = checkpoints.load(found)
        reference, _ = load_checkpoint(path_from_uri(meta["reference_uri"]))
        trainer = Trainer(model, hp, reference=reference, version=meta["version"], step=meta["step"],
                          optimizer_state=optimizer_state)
        log.info("resumed run %s at version %d (step %d) from %s", settings.run_id, trainer.version,
                 trainer.step_count, found)
        return trainer, meta
    if settings.learner_init_checkpoint:
        model, _ = load_checkpoint(path_from_uri(settings.learner_init_checkpoint))
        reference_uri = path_from_uri(settings.learner_init_checkpoint).resolve().as_uri()
    else:
        model = fresh_policy(settings.generator_seed)
        reference_uri = save_checkpoint(model, checkpoints.run_dir(settings) / "reference", {"version": 0}).as_uri()
    trainer = Trainer(model, hp)
    meta = {"offsets": {}, "trained_ids_past_offsets": [], "reference_uri": reference_uri}
    checkpoints.save(settings, trainer, {}, [], reference_uri)
    return trainer, meta


class GroupBuffer:
    """Trajectories by group, in arrival order, with the Kafka position of each record."""

    def __init__(self):
        self.groups: OrderedDict[str, list[tuple[trajectory_pb2.Trajectory, int, int]]] = OrderedDict()

    def add(self, t: trajectory_pb2.Trajectory, partition: int, offset: int) -> None:
        members = self.groups.setdefault(t.verdict.rollout.group_id, [])
        if all(m[0].id != t.id for m in members):  # a re-sent sample counts once
            members.append((t, partition, offset))

    def ready(self) -> list[str]:
        """Groups whose every emitted trajectory has arrived."""
        return [g for g, members in self.groups.items() if len(members) >= members[0][0].group_received]

    def take(self, group_ids: list[str]) -> list[tuple[trajectory_pb2.Trajectory, int, int]]:
        return [m for g in group_ids for m in self.groups.pop(g)]

    def resume_offsets(self, consumed: dict[int, int]) -> dict[int, int]:
        """Where a restart must read from: before the earliest record still waiting here, else past the last read."""
        offsets = dict(consumed)
        for members in self.groups.values():
            for _, partition, offset in members:
                offsets[partition] = min(offsets.get(partition, offset), offset)
        return offsets


def policy_message(settings: Settings, trainer: Trainer, uri: str, metrics: dict) -> policy_pb2.PolicyVersion:
    pv = policy_pb2.PolicyVersion(
        run_id=settings.run_id, version=trainer.version, checkpoint_uri=uri, step=trainer.step_count,
        metrics=policy_pb2.StepMetrics(**{k: metrics[k] for k in (
            "loss", "kl", "entropy", "grad_norm", "reward_mean", "pass_rate", "samples", "dropped_stale",
            "step_ms", "learning_rate") if k in metrics}),
    )
    pv.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return pv


async def run(settings: Settings, stop: asyncio.Event, *, servicer: LearnerServicer | None = None) -> Trainer:
    topic = settings.topic("trajectories")
    await bus.ensure_topics(["trajectories", "policy", "alerts"], settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    await asyncio.to_thread(store.migrate, client)
    trainer, meta = await asyncio.to_thread(build_trainer, settings)
    # Samples trained on that sit past the saved offsets (a restart re-reads them): id -> (partition, offset).
    trained_past: dict[str, tuple[int, int]] = {i: (-1, -1) for i in meta.get("trained_ids_past_offsets", [])}
    servicer = servicer or LearnerServicer(settings.run_id)
    tracer = telemetry.tracer("crucible.learner")

    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap,
                                group_id=settings.consumer_group_prefix + "learner",
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                isolation_level="read_committed")
    async with bus.Producer(settings) as producer:
        await consumer.start()
        try:
            await consumer.topics()  # loads cluster metadata, so partitions_for_topic can answer
            partitions = sorted(consumer.partitions_for_topic(topic) or {0})
            tps = [TopicPartition(topic, p) for p in partitions]
            consumer.assign(tps)
            for tp in tps:  # the checkpoint's offsets win: they are consistent with its weights
                if str(tp.partition) in meta.get("offsets", {}):
                    consumer.seek(tp, meta["offsets"][str(tp.partition)])
                elif (committed := await consumer.committed(tp)) is not None:
                    consumer.seek(tp, committed)
                else:
                    await consumer.seek_to_beginning(tp)
            latest = checkpoints.version_dir(settings, trainer.version)
            current = policy_message(settings, trainer, latest.as_uri(), {})
            await producer.send_and_wait("policy", current, key=settings.run_id)
            servicer.current = current
            buffer = GroupBuffer()
            monitor = HealthMonitor(settings.run_id)
            consumed: dict[int, int] = {int(p): o for p, o in meta.get("offsets", {}).items()}
            log.info("learner ready: run %s, version %d, %d groups per step, objective %s", settings.run_id,
                     trainer.version, settings.learner_groups_per_step, settings.learner_objective)
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=200, max_records=500)
                for tp, records in batches.items():
                    for record in records:
                        consumed[tp.partition] = record.offset + 1
                        try:
                            t = messages.decode(record.value, trajectory_pb2.Trajectory)
                        except messages.MessageDecodeError as exc:
                            await producer.send_raw(topic + bus.DLQ_SUFFIX, record.value, record.key, [
                                (bus.H_DLQ_REASON, f"undecodable: {exc}".encode()),
                                (bus.H_DLQ_SOURCE, f"{topic}/{tp.partition}@{record.offset}".encode())])
                            continue
                        if t.id in trained_past:
                            continue  # trained on before the restart
                        buffer.add(t, tp.partition, record.offset)
                ready = buffer.ready()
                while len(ready) >= settings.learner_groups_per_step:
                    chosen, ready = ready[: settings.learner_groups_per_step], ready[settings.learner_groups_per_step:]
                    taken = buffer.take(chosen)
                    with tracer.start_as_current_span("learner step"):
                        result = await asyncio.to_thread(trainer.step, [t for t, _, _ in taken])
                    offsets = buffer.resume_offsets(consumed)
                    trained_past.update({t.id: (p, o) for t, p, o in taken})
                    trained_past = {i: (p, o) for i, (p, o) in trained_past.items()
                                    if p < 0 or o >= offsets.get(p, 0)}
                    folder = await asyncio.to_thread(checkpoints.save, settings, trainer, offsets,
                                                     sorted(trained_past), meta["reference_uri"])
                    current = policy_message(settings, trainer, folder.as_uri(), result.metrics)
                    await producer.send_and_wait("policy", current, key=settings.run_id)
                    servicer.current = current
                    await asyncio.to_thread(record_step, client, settings, trainer, result.metrics, folder.as_uri())
                    for alert in monitor.check(trainer.step_count, trainer.version, result.metrics):
                        log.warning("alert %s: %s", alert.kind, alert.message)
                        await producer.send_and_wait("alerts", alert, key=alert.kind)
                        await asyncio.to_thread(record_alert, client, alert)
                    await consumer.commit({TopicPartition(topic, p): o for p, o in offsets.items()})
                    m = result.metrics
                    log.info("step %d -> version %d: reward %.3f pass %.3f loss %.4f kl %.4f (%d samples, "
                             "%d stale dropped, %.0f ms)", trainer.step_count, trainer.version, m["reward_mean"],
                             m["pass_rate"], m["loss"], m["kl"], m["samples"], m["dropped_stale"], m["step_ms"])
        finally:
            await consumer.stop()
    return trainer


def record_alert(client, alert) -> None:
    client.insert("alerts", [[alert.id, alert.kind, "warning", alert.message, dict(alert.details),
                              alert.created_at.ToDatetime(tzinfo=dt.timezone.utc)]],
                  column_names=["alert_id", "kind", "severity", "message", "details", "ts"])


def record_step(client, settings: Settings, trainer: Trainer, m: dict, uri: str) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    client.insert("train_steps", [[settings.run_id, trainer.step_count, trainer.version, m["loss"], m["kl"],
                                   m["entropy"], m["grad_norm"], m["reward_mean"], m["pass_rate"], m["learning_rate"],
                                   m["step_ms"], now]], column_names=TRAIN_STEP_COLUMNS)
    numeric = {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
    client.insert("policy_versions", [[settings.run_id, trainer.version, uri, trainer.step_count, now, numeric]],
                  column_names=["run_id", "version", "checkpoint_uri", "step", "created_at", "metrics"])


async def main() -> None:
    settings = service.setup("learner")
    stop = service.stop_event()
    servicer = LearnerServicer(settings.run_id)
    server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", servicer, policy_pb2_grpc.add_LearnerServicer_to_server)],
                           host=settings.grpc_host, port=settings.learner_grpc_port)
    async with server:
        await run(settings, stop, servicer=servicer)


if __name__ == "__main__":
    asyncio.run(main())
