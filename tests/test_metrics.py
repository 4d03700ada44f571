"""Metrics: OTel instruments rendered in the Prometheus text format, and a real Prometheus scraping a service."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider

from crucible.local.prometheus import LocalPrometheus, binary
from crucible.shared import metrics, rpc
from crucible.shared.procs import free_port, stop_processes
from crucible.v1 import execution_pb2, execution_pb2_grpc


def test_counters_histograms_and_gauges_render_as_prometheus_text():
    reader = metrics.PrometheusReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    jobs = meter.create_counter("crucible.sandbox.jobs", description="jobs run")
    latency = meter.create_histogram("crucible.sandbox.job.duration", unit="ms")
    meter.create_observable_gauge("crucible.bus.consumer_lag",
                                  callbacks=[lambda o: [Observation(7, {"topic": 'a"b\\c', "partition": "0"})]])
    jobs.add(2, {"outcome": "ok"})
    jobs.add(1, {"outcome": "timeout"})
    for ms in (3.0, 30.0, 3000.0):
        latency.record(ms, {"outcome": "ok"})
    text = reader.render()
    lines = text.splitlines()
    assert "# TYPE crucible_sandbox_jobs_total counter" in lines
    assert 'crucible_sandbox_jobs_total{outcome="ok"} 2' in lines
    assert 'crucible_sandbox_jobs_total{outcome="timeout"} 1' in lines
    assert "# TYPE crucible_sandbox_job_duration histogram" in lines
    buckets = [line for line in lines if line.startswith("crucible_sandbox_job_duration_bucket")]
    counts = [int(line.rsplit(" ", 1)[1]) for line in buckets]
    assert counts == sorted(counts) and counts[-1] == 3 and 'le="+Inf"' in buckets[-1]  # cumulative
    assert 'crucible_sandbox_job_duration_sum{outcome="ok"} 3033.0' in lines
    assert 'crucible_sandbox_job_duration_count{outcome="ok"} 3' in lines
    assert 'crucible_bus_consumer_lag{partition="0",topic="a\\"b\\\\c"} 7' in lines


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.kafka
async def test_prometheus_scrapes_a_services_metrics(settings, tmp_path):
    assert binary(), "prometheus is not installed: `crucible test` installs Debian's package"
    port_file, grpc_port = tmp_path / "sandbox.port", free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_")},  # PYTHONPYCACHEPREFIX too
           "CRUCIBLE_HOME": str(tmp_path / "home"), "CRUCIBLE_METRICS_PORT": "0",
           "CRUCIBLE_METRICS_PORT_FILE": str(port_file), "CRUCIBLE_SANDBOX_GRPC_PORT": str(grpc_port),
           "CRUCIBLE_SANDBOX_WORKERS": "1", "CRUCIBLE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
           "CRUCIBLE_TOPIC_PREFIX": settings.topic_prefix, "CRUCIBLE_CONSUMER_GROUP_PREFIX": settings.consumer_group_prefix,
           "CRUCIBLE_OTEL_STORE_SPANS": "false"}
    service = subprocess.Popen([sys.executable, "-m", "crucible.services.sandbox_executor"],
                               env=env, stdout=open(tmp_path / "service.log", "wb"), stderr=subprocess.STDOUT)
    prometheus = None
    try:
        await rpc.wait_serving(f"127.0.0.1:{grpc_port}", "crucible.v1.Sandbox", timeout=60)
        async with rpc.channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = execution_pb2_grpc.SandboxStub(channel)
            for code in ("print(1)", "raise SystemExit(3)", "print(2)"):
                await stub.Execute(execution_pb2.ExecuteRequest(language="python", code=code), timeout=60)
        metrics_port = int(port_file.read_text())
        prometheus = LocalPrometheus(tmp_path / "prometheus", free_port(),
                                     {"sandbox-executor": f"127.0.0.1:{metrics_port}"}).start()
        for _ in range(60):
            jobs = prometheus.query("sum by (outcome) (crucible_sandbox_job_duration_count)")
            if jobs:
                break
            await asyncio.sleep(0.5)
        by_outcome = {r["metric"]["outcome"]: float(r["value"][1]) for r in jobs}
        assert by_outcome == {"ok": 2.0, "exit_nonzero": 1.0}, by_outcome
        up = prometheus.query('up{job="sandbox-executor"}')
        assert up and up[0]["value"][1] == "1"
        assert prometheus.query("crucible_sandbox_job_max_rss_sum > 0")
    finally:
        if prometheus:
            prometheus.stop()
        stop_processes([service], timeout=10)
