"""`crucible status`: what an operator asks first. Is the broker up, is the store up, how far behind
is each consumer group on each topic, what is each run's newest policy version, and what were the
last alerts. Each part says plainly when it cannot be known (broker or store unreachable)."""
from __future__ import annotations

import asyncio
from collections import defaultdict

from crucible.shared import bus, store
from crucible.shared.settings import Settings, shown_url
from crucible.shared.text import shown


async def consumer_lag(settings: Settings, timeout_s: float = 10.0) -> dict[str, dict[str, int]]:
    """{consumer group: {topic: records not yet consumed}} for this deployment's groups and topics."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**bus.connection(settings), request_timeout_ms=int(timeout_s * 1000))
    await admin.start()
    reader = AIOKafkaConsumer(**bus.connection(settings), enable_auto_commit=False)
    await reader.start()
    try:
        groups = [g[0] for g in await admin.list_consumer_groups() if g[0].startswith(settings.consumer_group_prefix)]
        lag: dict[str, dict[str, int]] = {}
        for group in sorted(groups):
            committed = await admin.list_consumer_group_offsets(group)
            mine = {tp: meta for tp, meta in committed.items() if tp.topic.startswith(settings.topic_prefix)}
            if not mine:
                continue
            ends = await reader.end_offsets(list(mine))
            per_topic: dict[str, int] = defaultdict(int)
            for tp, meta in mine.items():
                per_topic[tp.topic] += max(0, ends[tp] - max(meta.offset, 0))
            lag[group] = dict(per_topic)
        return lag
    finally:
        await reader.stop()
        await admin.close()


def store_view(settings: Settings) -> tuple[list[tuple], list[tuple]]:
    """(each run's newest policy version and when, the last alerts)."""
    client = store.connect(settings, create_database=False)
    runs = client.query("SELECT run_id, max(version), max(created_at) FROM policy_versions FINAL GROUP BY run_id "
                        "ORDER BY max(created_at) DESC LIMIT 10").result_rows
    alerts = client.query("SELECT ts, kind, severity, substring(message, 1, 120) FROM alerts FINAL "
                          "ORDER BY ts DESC LIMIT 8").result_rows
    return runs, alerts


# The variable holding each gRPC service's port, in its process's environment.
_PORT_VARIABLES = {"control": "CRUCIBLE_CONTROL_GRPC_PORT", "sandbox_executor": "CRUCIBLE_SANDBOX_GRPC_PORT",
                   "verifier": "CRUCIBLE_VERIFIER_GRPC_PORT", "generator": "CRUCIBLE_GENERATOR_GRPC_PORT",
                   "learner": "CRUCIBLE_LEARNER_GRPC_PORT"}


def _health(target: str) -> str:
    """The grpc.health.v1 status of the server at `target` (blocking: this command has no event loop)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return f"not answering ({exc.code().name})"


def services_view(settings: Settings) -> list[tuple[str, dict[str, str]]]:
    """(whose, {service: "pid N, gRPC SERVING"}) for `crucible up` and each run under CRUCIBLE_HOME with
    services running on this machine."""
    from pathlib import Path

    from crucible.local.services import recorded

    folders = [("crucible up", settings.home / "up")] + [
        (f"run {p.name}", p) for p in sorted((settings.home / "runs").glob("*"))]
    view = []
    for whose, folder in folders:
        alive = recorded(folder)
        if not alive:
            continue
        described = {}
        for name, pid in sorted(alive.items()):
            described[name] = f"pid {pid}"
            try:
                environ = dict(item.split("=", 1) for item in
                               Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
            except OSError:
                continue
            variable = _PORT_VARIABLES.get(name)
            port = environ.get(variable) if variable else None
            if port is None and variable:
                port = str(Settings.model_fields[variable.removeprefix("CRUCIBLE_").lower()].default)
            if port:
                health = _health(f"127.0.0.1:{port}")
                described[name] += f", gRPC {health}"
        view.append((whose, described))
    return view


def report(settings: Settings, echo=print) -> int:
    """Prints the status; 0 when broker and store both answer, 1 otherwise."""
    healthy = True
    for whose, services in services_view(settings):
        echo(f"services of {shown(whose)}:")
        for name, description in services.items():
            echo(f"  {shown(name):18s} {shown(description)}")
    try:
        lag = asyncio.run(asyncio.wait_for(consumer_lag(settings), 20))
        echo(f"Kafka  {settings.kafka_bootstrap}: up")
        if not lag:
            echo("  no consumer group of this deployment has committed anything yet")
        for group, topics in lag.items():
            behind = ", ".join(f"{shown(t.removeprefix(settings.topic_prefix))} {n}"
                               for t, n in sorted(topics.items()))
            echo(f"  {shown(group):40s} behind by: {behind}")
    except Exception as exc:
        healthy = False
        echo(f"Kafka  {settings.kafka_bootstrap}: not answering ({type(exc).__name__}); `crucible up` starts the local one")
    try:
        runs, alerts = store_view(settings)
        echo(f"store  {shown_url(settings.clickhouse_url)} (database {settings.clickhouse_database}): up")
        for run_id, version, at in runs:
            echo(f"  run {shown(run_id)}: policy version {version} at {at}")
        if not runs:
            echo("  no run has published a policy version yet")
        echo("  last alerts:" if alerts else "  no alerts")
        for ts, kind, severity, message in alerts:
            echo(f"    {ts}  {shown(severity):8s} {shown(kind)}: {shown(message)}")
    except Exception as exc:
        healthy = False
        echo(f"store  {shown_url(settings.clickhouse_url)}: not answering or not migrated ({type(exc).__name__}: "
             f"{shown(str(exc)[:120])}); `crucible up` starts the local one")
    return 0 if healthy else 1
