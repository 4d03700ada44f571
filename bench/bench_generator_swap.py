"""How soon every generator samples with a newly published policy version, for 1 to N generators.

    python bench/bench_generator_swap.py [--generators 1 2 4] [--versions 6] [--interval 2]

Starts a broker of its own, then N generator processes (the real service, torch backend, the
built-in policy) that share one run. For each of `versions` new checkpoints it publishes a signed
PolicyVersion as the learner does and reads from each generator's log when it had loaded that
version: the swap latency is publication -> loaded (the policy topic's delivery, the checkpoint's
hash check, the load; a generator swaps between batches, so one in the middle of a batch also
waits for that batch). Prints the median and the worst over versions 2.. and generators, the load
alone, and apart the worst for version 1, the first after start (consumers may still be joining). Idle generators: under load add at most one batch's sampling time. Not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crucible.cli.train import service_env
from crucible.local.kafka import LocalKafka
from crucible.ml.policy import transfer
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.shared import bus
from crucible.shared.procs import free_port, free_ports, stop_processes
from crucible.shared.settings import Settings
from crucible.v1 import policy_pb2

LOADED = re.compile(r"^(\S+ \S+) generator INFO loaded policy version (\d+) from \S+ in (\d+) ms")


def loaded_at(log: Path) -> dict[int, tuple[float, float]]:
    """version -> (when it was loaded, epoch seconds; load ms) from a generator's log."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        if m := LOADED.match(line):
            when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found[int(m.group(2))] = (when, float(m.group(3)))
    return found


async def measure(settings: Settings, root: Path, n: int, versions: int, interval: float) -> tuple[list, list, list]:
    """Swap latencies (ms) of versions 2.., load times, and the first version's latencies (which include
    the generators' consumers joining, if they had not yet)."""
    ckpts = root / f"ckpt-{n}"
    model = fresh_policy(0)
    folders = []
    for v in range(versions + 1):
        with __import__("torch").no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        folders.append(save_checkpoint(model, ckpts / f"v{v:06d}", {"version": v}))
    run_id = f"swap-{n}"
    s = settings.model_copy(update={"run_id": run_id, "topic_prefix": f"crucible.{run_id}.",
                                    "consumer_group_prefix": f"crucible-{run_id}-"})
    await bus.ensure_topics(["tasks", "policy"], settings=s)
    procs, logs = [], []
    for i in range(n):
        env = service_env(s, {**s.run_config().environment(), "CRUCIBLE_TOPIC_PREFIX": s.topic_prefix,
                              "CRUCIBLE_CONSUMER_GROUP_PREFIX": s.consumer_group_prefix,
                              "CRUCIBLE_INIT_CHECKPOINT": folders[0].as_uri(), "CRUCIBLE_METRICS_PORT": "0",
                              "CRUCIBLE_GENERATOR_GRPC_PORT": str(free_port()),
                              "CRUCIBLE_INSTANCE_ID": f"swap-{n}-{i}", "OMP_NUM_THREADS": "1"})
        logs.append(root / f"gen-{n}-{i}.log")
        with open(logs[-1], "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "crucible.services.generator"], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    latencies, loads, firsts = [], [], []
    try:
        deadline = time.monotonic() + 120
        while not all("ready at policy version" in log.read_text(errors="replace") for log in logs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("generators did not start:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
            await asyncio.sleep(0.2)
        await asyncio.sleep(3)  # consumers joined and assigned
        async with bus.Producer(s) as producer:
            for v in range(1, versions + 1):
                pv = policy_pb2.PolicyVersion(run_id=run_id, version=v, checkpoint_uri=folders[v].as_uri(), step=v,
                                              checkpoint_sha256=transfer.content_hash(folders[v]))
                pv.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
                published = time.time()
                await producer.send_and_wait("policy", pv, key=run_id)
                deadline = time.monotonic() + 60
                while not all(v in loaded_at(log) for log in logs):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"version {v} not loaded everywhere:\n" + logs[0].read_text()[-2000:])
                    await asyncio.sleep(0.05)
                for log in logs:
                    when, ms = loaded_at(log)[v]
                    (latencies if v > 1 else firsts).append((when - published) * 1000)
                    loads.append(ms)
                await asyncio.sleep(interval)
    finally:
        stop_processes(procs, timeout=20)
    return latencies, loads, firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--interval", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crucible-bench-swap-") as tmp:
        root = Path(tmp)
        ports = free_ports(2)
        broker = LocalKafka(root / "kafka", port=ports[0], controller_port=ports[1], heap="512m",
                            settings=Settings(home=root))
        broker.start(echo=lambda *_: None)  # (it waits for the broker with an event loop of its own)
        try:
            settings = Settings(home=root / "home", kafka_bootstrap=broker.bootstrap)
            print(f"policy version -> every generator sampling with it ({args.versions} versions, idle generators; "
                  "log timestamps are to the millisecond)")
            print(f"{'generators':>10} {'p50 ms':>8} {'max ms':>8} {'load p50 ms':>12} {'first version, max ms':>22}")
            for n in args.generators:
                latencies, loads, firsts = asyncio.run(measure(settings, root, n, args.versions, args.interval))
                print(f"{n:>10} {statistics.median(latencies):>8.0f} {max(latencies):>8.0f} "
                      f"{statistics.median(loads):>12.0f} {max(firsts):>22.0f}")
        finally:
            broker.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
