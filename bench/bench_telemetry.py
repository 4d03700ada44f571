"""What watching costs: bus throughput with tracing (spans into the store) and metrics on, against off.

    python bench/bench_telemetry.py [--messages 5000] [--rounds 2]

Starts a Kafka broker and a store, then runs the same hop in fresh processes, alternating the two
settings `--rounds` times: N tasks published, then consumed by a bus.Consumer whose handler
publishes one record per task (decode, handle, produce, commit: a service's hop).
  off:     no tracer or meter provider (the OpenTelemetry API's no-op defaults);
  spans:   the SDK's tracer provider making every span (every trace kept), exporting none;
  metrics: spans as above plus the metric instruments, the Prometheus endpoint up (not scraped);
  all:     every span written into the store's otel_traces (batched), and metrics;
  on:      what every service runs: as `all`, with the default share of traces kept (head sampling).
Prints records/s for each and its ratio to off. Not a test: nothing gates on it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crucible.local.kafka import LocalKafka
from crucible.local.store.launcher import spawn_store, stop_store, wait_ready
from crucible.shared.procs import free_port, free_ports
from crucible.shared.settings import Settings


async def hop(settings: Settings, n: int, tag: str) -> float:
    from crucible.shared import bus
    from crucible.v1 import task_pb2

    await bus.ensure_topics(["tasks", "rollouts"], settings=settings)
    async with bus.Producer(settings) as producer:
        for i in range(n):
            await producer.send("tasks", task_pb2.Task(id=f"{tag}-{i}", kind="exact", prompt="x" * 200), key=str(i))
        await producer.flush()

    async def handler(incoming):
        return [bus.Outgoing("rollouts", incoming.message, key=incoming.message.id)]

    async with bus.Consumer(["tasks"], f"bench-{tag}", handler, settings=settings, batch_size=500) as consumer:
        await consumer.run(max_records=1)
        started = time.perf_counter()
        await consumer.run(max_records=n - 1)
        return (n - 1) / (time.perf_counter() - started)


def child(mode: str, bootstrap: str, store: str, n: int, tag: str) -> None:
    settings = Settings(kafka_bootstrap=bootstrap, clickhouse_url=store, topic_prefix=f"bench.{tag}.",
                        metrics_port=0, otel_store_spans=mode in ("all", "on"),
                        **({} if mode == "on" else {"otel_trace_ratio": 1.0}))
    if mode != "off":
        from crucible.shared import metrics, telemetry

        telemetry.setup_telemetry("bench-telemetry", settings)
        if mode in ("metrics", "all", "on"):
            metrics.setup_metrics("bench-telemetry", settings)
    rate = asyncio.run(hop(settings, n, tag))
    if mode in ("all", "on"):
        from opentelemetry import trace

        trace.get_tracer_provider().force_flush()  # the spans do reach the store
    print(json.dumps({"rate": rate}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=4, metavar=("MODE", "BOOTSTRAP", "STORE", "TAG"))
    args = parser.parse_args()
    if args.child:
        mode, bootstrap, store, tag = args.child
        child(mode, bootstrap, store, args.messages, tag)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ports = free_ports(2)
        broker = LocalKafka(Path(tmp) / "kafka", port=ports[0], controller_port=ports[1], settings=Settings())
        broker.start(echo=lambda *_: None)
        port = free_port()
        store_proc = spawn_store(Path(tmp) / "store", port=port, log_path=Path(tmp) / "store.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url)
            from crucible.shared import store

            store.migrate(store.connect(Settings(clickhouse_url=url)))
            modes = ("off", "spans", "metrics", "all", "on")
            rates: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in modes:
                    out = subprocess.run([sys.executable, __file__, "--messages", str(args.messages), "--child", mode,
                                          broker.bootstrap, url, f"{mode}{r}"], capture_output=True, text=True)
                    if out.returncode != 0:
                        raise SystemExit(out.stderr[-2000:])
                    rates[mode].append(json.loads(out.stdout.strip().splitlines()[-1])["rate"])
            spans = store.connect(Settings(clickhouse_url=url)).query(
                "SELECT count() FROM otel_traces").result_rows[0][0]
            off = statistics.median(rates["off"])
            print(f"{args.messages} records a run, {args.rounds} runs each (medians; {spans} spans stored in all):")
            for mode in modes:
                rate = statistics.median(rates[mode])
                print(f"  {mode:8s} {rate:8.0f} records/s  ratio to off {rate / off:.2f}  "
                      f"{[round(r) for r in rates[mode]]}")
        finally:
            stop_store(store_proc)
            broker.stop()


if __name__ == "__main__":
    main()
