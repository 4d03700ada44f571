"""How fast a sandbox comes up: from starting its process to serving N jails.

    python bench/bench_sandbox_cold_start.py [--workers 1 2] [--jobs 32] [--runs 3]

Each run starts a fresh Python process (as a new sandbox-executor pod's container would), which
imports the service's modules, starts the jail pool (workers, each with its zygote, isolation
probed), then submits N jobs at once (`print(1)`, untested: the jail's own cost) and records, from
the moment the process was spawned:
  - imported: the interpreter and the service's modules are loaded;
  - ready:    the pool accepts jobs (every worker forked, its zygote ready);
  - first:    the first job's result is back (the first jail served);
  - all N:    every job's result is back;
and the rate after ready (N / (all - ready)). Medians over the runs. What a pod adds on top (image
pull, scheduling, the broker connection and the gRPC server) is outside this figure; the sizing
guide (docs/scaling.md) states it as an assumption. Not a test: nothing gates on these numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time


def child(workers: int, jobs: int, spawned: float) -> None:
    from crucible.services.sandbox_executor.pool import Job, SandboxPool
    from crucible.shared.settings import Settings

    imported = time.time()

    async def go() -> dict:
        settings = Settings(sandbox_workers=workers, sandbox_queue_size=jobs)
        async with SandboxPool(settings, allow_weak=None if os.geteuid() == 0 else True) as pool:
            ready = time.time()
            done: list[float] = []

            async def one(i: int):
                result = await pool.execute(Job(code=f"print({i})"))
                assert result.stdout.strip() == str(i).encode(), result
                done.append(time.time())

            await asyncio.gather(*(one(i) for i in range(jobs)))
            return {"imported": imported - spawned, "ready": ready - spawned, "first": min(done) - spawned,
                    "all": max(done) - spawned, "rate": jobs / (max(done) - ready)}

    print(json.dumps(asyncio.run(go())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), int(args.child[1]), float(args.child[2]))
        return
    print(f"sandbox cold start: fresh process -> pool ready -> {args.jobs} jobs served (median of {args.runs} runs, "
          "seconds from spawn)")
    print(f"{'workers':>8} {'imported':>9} {'ready':>7} {'first':>7} {'all ' + str(args.jobs):>8} {'jobs/s after ready':>19}")
    for workers in dict.fromkeys(args.workers):
        runs = []
        for _ in range(args.runs):
            spawned = time.time()
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(workers), str(args.jobs),
                                  repr(spawned)], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{workers:>8} {med['imported']:>9.2f} {med['ready']:>7.2f} {med['first']:>7.2f} {med['all']:>8.2f} "
              f"{med['rate']:>19.1f}")


if __name__ == "__main__":
    main()
