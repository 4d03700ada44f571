"""A pool of pre-forked jail workers behind a bounded queue (the backpressure point).

Each worker is a jail fork server (`jail/`) started with an empty environment,
kept and restarted by crucible.shared.workers; a job is two frames to a worker
(header, body) and one frame back. The queue is bounded: when it is full,
`execute` raises PoolFull at once (gRPC answers RESOURCE_EXHAUSTED, the Kafka
consumer pauses) instead of letting latency grow without limit.
"""
from __future__ import annotations

import asyncio
import base64
import fcntl
import importlib
import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from crucible.services.sandbox_executor import isolation
from crucible.services.sandbox_executor.jail.cgroups import JAIL_OWN_TASKS, Cgroups
from crucible.services.sandbox_executor.runners import prepare
from crucible.shared import metrics
from crucible.shared.settings import Settings, get_settings
from crucible.shared.text import valid_texts
from crucible.shared.workers import PoolFull, WorkerFailed, WorkerPool  # noqa: F401 (PoolFull is part of this API)

log = logging.getLogger(__name__)

RUNTIME_PREFIX = "crucible-sandbox-"  # a pool's runtime folder and cgroup slots: <prefix><pid>-<id>
JAIL_MAIN = Path(__file__).with_name("jail") / "__main__.py"
# The packages the jail worker runs from (it cannot import the installed package: see jail/__main__.py).
JAIL_PACKAGES = ("crucible.shared", "crucible.services.sandbox_executor")
# Standard-library modules preloaded once per worker and inherited by every job, so that a program
# importing one finds it loaded. Each is paid by every job, importing it or not: a jail is a fork of
# the worker's zygote, whose every mapped page is copied into the jail's page tables at the fork (and
# write-protected in both), and torn down at the jail's exit. Measured here (two workers, HumanEval
# checks, alternated 15 s runs): dropping fractions, decimal, statistics, datetime and dataclasses
# (~1.9 MB of the zygote's ~9 MB of anonymous memory) gave 6-9% more jobs a second in each pair,
# about 0.4 ms of CPU a job per MB carried. A module belongs here when the share of jobs whose program
# imports it, times its import in a jail (2.5-11 ms for those dropped; hashlib and traceback 4 ms),
# exceeds what carrying it costs every job. What stays is what model-written code imports most and is
# light to carry (typing, the heaviest, ~1 MB with what it loads, is imported by 21 of HumanEval's 164
# programs; then math, collections, re, ...); hashlib (one program in 164, 0.6 MB with libcrypto's
# relocated pages) goes. Tests import too (HumanEval's: random, copy, string, math), but they run in
# the slot's long-lived harness, where an import is paid once in its life. The python environment's
# runner takes json, contextlib (loaded with typing) and io (always loaded). A module not listed
# imports as usual, from the jail's read-only standard library.
PRELOAD = ("typing", "math", "random", "copy", "string", "collections", "re", "itertools", "functools", "heapq",
           "bisect", "json", "operator")
MAX_JOB_BYTES = 8 * 1024 * 1024
# Jobs a worker takes at once: with two, the next job is already in its pipe when one ends, so no
# worker idles through a result's round trip (its replies name their jobs: shared.workers' keyed replies).
DEPTH = 2
# A worker's cgroup slots: each running job holds one until its teardown (after its result) has
# emptied it, and the jail prepared for the next job waits in another: DEPTH running and DEPTH torn
# down, plus the prepared one, so no job waits for a slot and reaping never touches another job.
SLOTS = "abcde"  # each with a job uid of its own (and its harness runs as that uid)
HARNESS_GROUP = "h"  # the leaf of the cgroup a worker's harnesses share (w<index>h)
# The worker's command line (`python -I -S -B -c BOOT`): reads the length-prefixed configuration from
# stdin and runs jail/__main__.py with it; nothing of the host is on the command line.
BOOT = """import json, os
def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise SystemExit("the sandbox worker's configuration was cut short")
        data += chunk
    return data
header = b""
while not header.endswith(b"\\n"):
    header += read(1)
cfg = json.loads(read(int(header)))
with open(cfg["main"], "rb") as f:
    code = compile(f.read(), "/crucible/services/sandbox_executor/jail/__main__.py", "exec", dont_inherit=True)
del header, read, f
exec(code, {"__name__": "__main__", "CONFIG": cfg})
"""


JOB_MS = metrics.histogram("crucible.sandbox.job.duration", "wall time of one sandbox job, by outcome", "ms")
JOB_CPU = metrics.histogram("crucible.sandbox.job.cpu_time", "CPU time (user + system) of one job", "s")
JOB_RSS = metrics.histogram("crucible.sandbox.job.max_rss", "peak resident memory of one job", "By")

class JobRejected(ValueError):
    """The job itself is unacceptable (unknown language, too large, bad limits); the text says why."""


@dataclass(frozen=True)
class Limits:
    wall_s: float
    cpu_s: int
    memory_bytes: int
    file_bytes: int
    work_bytes: int
    output_bytes: int
    processes: int
    open_files: int

    @classmethod
    def from_settings(cls, s: Settings) -> "Limits":
        return cls(wall_s=s.sandbox_wall_s, cpu_s=s.sandbox_cpu_s, memory_bytes=s.sandbox_memory_mb << 20,
                   file_bytes=s.sandbox_file_mb << 20, work_bytes=s.sandbox_work_mb << 20,
                   output_bytes=s.sandbox_output_bytes, processes=s.sandbox_processes,
                   open_files=s.sandbox_open_files)

    def narrowed(self, timeout_s: float = 0, memory_bytes: int = 0) -> "Limits":
        """Per-job limits may tighten the service's limits, never loosen them."""
        limits = self
        if timeout_s:
            if not 0 < timeout_s <= self.wall_s:
                raise JobRejected(f"timeout_s={timeout_s} must be in (0, {self.wall_s}] (CRUCIBLE_SANDBOX_WALL_S)")
            limits = replace(limits, wall_s=timeout_s, cpu_s=max(1, min(self.cpu_s, int(timeout_s + 0.999))))
        if memory_bytes:
            if not 32 << 20 <= memory_bytes <= self.memory_bytes:
                raise JobRejected(f"memory_bytes={memory_bytes} must be in [32 MiB, {self.memory_bytes}]")
            limits = replace(limits, memory_bytes=memory_bytes)
        return limits


@dataclass
class Job:
    code: str
    language: str = "python"
    tests: str = ""
    entry_point: str = ""
    stdin: bytes = b""
    timeout_s: float = 0.0
    memory_bytes: int = 0
    prelude: str = ""  # trusted code run before the tests, in the harness only (a HumanEval prompt's helpers)


@dataclass
class Result:
    exit_code: int = 0
    signal: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    tests: list[dict] = field(default_factory=list)
    tests_declared: list[str] = field(default_factory=list)  # what the harness collected before running any
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    max_rss_bytes: int = 0
    usage_source: str = "rusage"  # "cgroup": counted by the job's cgroup, every process it started
    duration_ms: float = 0.0
    isolation: str = "full"
    missing_guarantees: list[str] = field(default_factory=list)
    violation: str = ""
    violation_detail: str = ""
    tamper: list[dict] = field(default_factory=list)  # {"pattern", "detail"} the harness saw the candidate try


def worker_cpus(index: int, workers: int, available: list[int]) -> list[int] | None:
    """The CPUs worker `index` (and every process it makes) runs on: one of its own where the service
    may run on exactly as many CPUs as it has workers, two or more; else all (None). A job's processes
    then wake each other (a tested job's calls across its two processes, the supervisor's hand-offs,
    the zygote's replies) on the CPU they run on, not across CPUs. bench_sandbox.py, 2 workers on 2
    cores, alternated: 278-310 tested checks/s pinned against 246-272 not. With fewer workers than
    CPUs nothing is pinned: a pod that sees all of its node's CPUs would otherwise put its workers
    on the same first few as every other pod on the node."""
    if workers < 2 or workers != len(available):
        return None
    return [available[index]]


class SandboxPool:
    def __init__(self, settings: Settings | None = None, *, workers: int | None = None,
                 allow_weak: bool | None = None):
        self.settings = settings or get_settings()
        self.size = workers or self.settings.sandbox_workers or os.cpu_count() or 1
        self.allow_weak = self.settings.sandbox_allow_weak_isolation if allow_weak is None else allow_weak
        self.limits = Limits.from_settings(self.settings)
        self.runtime_dir = Path(f"/tmp/{RUNTIME_PREFIX}{os.getpid()}-{id(self):x}")
        self.report = isolation.IsolationReport()
        # A worker being replaced leaves when its stdin closes, once the jobs it still runs are
        # over and reaped; the grace covers that, a kill follows it.
        self._workers = WorkerPool("sandbox worker", self.size, self._spawn, ready=_ready,
                                   max_waiting=self.settings.sandbox_queue_size or 4 * self.size,
                                   stop_grace_s=5.0, depth=DEPTH, key_of=_job_of)
        self._ids = itertools.count()
        self._cgroup_dirs: list[Path] = []
        self._leases: UidLeases | None = None

    # --- lifecycle ---

    async def start(self) -> "SandboxPool":
        self.report = isolation.probe()
        if self.report.missing and not self.allow_weak:
            raise isolation.IsolationError(
                "refusing to run untrusted code without full isolation: " + "; ".join(
                    self.report.missing_guarantees)
                + ". Start with CRUCIBLE_SANDBOX_ALLOW_WEAK_ISOLATION=1 (or --allow-weak-isolation) to accept this.")
        log.warning("sandbox: %s", self.report.describe()) if self.report.missing else \
            log.info("sandbox: %s", self.report.describe())
        swept = sweep_abandoned()
        if swept:
            log.info("sandbox: removed %d cgroup and runtime folders left by pools that died", swept)
        self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self._leases = UidLeases(self.settings.sandbox_uid_base, self.size * len(SLOTS))
            await self._workers.start()
        except BaseException:
            await self.close()  # no caller will: `async with` does not exit what did not enter
            raise
        return self

    @property
    def uids(self) -> list[int]:
        """The uids the workers run jobs as, one per cgroup slot (held for this pool while it runs): jobs
        running at once in a worker never share a uid, nor its process limit (RLIMIT_NPROC counts a uid)."""
        return self._leases.uids if self._leases else []

    async def close(self) -> None:
        await self._workers.close()
        if self._leases:
            self._leases.release()
            self._leases = None
        for d in sorted(set(self._cgroup_dirs), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:  # something still in it (a worker killed at its grace's end): end it, once more
                Cgroups({"pids": str(d)}).reap()  # any controller's folder lists its processes
                try:
                    d.rmdir()
                except OSError:
                    pass
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    async def __aenter__(self) -> "SandboxPool":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        """Starts jail worker `index`: its own root directory, cgroup slots and uid."""
        root_dir = self.runtime_dir / f"w{index}"
        root_dir.mkdir(parents=True, exist_ok=True)
        binds, hidden, symlinks = isolation.readonly_binds()
        config = {
            "packages": {name: list(importlib.import_module(name).__path__) for name in JAIL_PACKAGES},
            "root_dir": str(root_dir),
            "ro_binds": binds,
            "hidden": hidden,
            "symlinks": symlinks,
            "uids": self.uids[index * len(SLOTS):(index + 1) * len(SLOTS)],  # one per slot
            "isolate": "namespaces" not in self.report.missing,
            "seccomp": "seccomp" not in self.report.missing,
            "cgroups": self.make_cgroups(index),
            "harness_cgroup": self.make_harness_cgroup(index),
            "preload": PRELOAD,
            "work_bytes": self.limits.work_bytes,
            "harness_memory_bytes": self.limits.memory_bytes,
            "cpus": worker_cpus(index, self.size, sorted(os.sched_getaffinity(0))),
        }
        proc = await asyncio.create_subprocess_exec(
            isolation.base_python(), "-I", "-S", "-B", "-c", BOOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
            env={},  # the service's secrets never reach a worker
        )
        # The configuration goes over stdin: a job can read the command line, and must see nothing of the host.
        data = json.dumps({**config, "main": str(JAIL_MAIN)}).encode()
        proc.stdin.write(b"%d\n" % len(data) + data)
        await proc.stdin.drain()
        return proc

    # --- jobs ---

    def has_capacity(self) -> bool:
        return self._workers.has_capacity()

    def check(self, job: Job) -> tuple[Limits, str, bytes]:
        """(its limits, its main file, its payload), or JobRejected saying why the pool will not run it."""
        limits = self.limits.narrowed(job.timeout_s, job.memory_bytes)
        files, main, tests = prepare(job)
        body = {"files": files, "entry_point": job.entry_point, "stdin_b64": base64.b64encode(job.stdin).decode()}
        if tests is not None:
            body.update(tests=tests, prelude=job.prelude)
        payload = json.dumps(body).encode()
        if len(payload) > MAX_JOB_BYTES:
            raise JobRejected(f"job is {len(payload)} bytes; the limit is {MAX_JOB_BYTES}")
        return limits, main, payload

    async def execute(self, job: Job) -> Result:
        """Runs one job; raises PoolFull when the queue is at its bound, JobRejected for a bad job."""
        limits, main, payload = self.check(job)
        header = {"job_id": next(self._ids), "main": main, "limits": dict(limits.__dict__),
                  "work_bytes": limits.work_bytes}
        async with self._workers.worker() as worker:
            try:
                # Text the job's processes wrote (a test's message, a tamper detail) may hold a lone surrogate
                # (`raise ValueError("\\ud800")`): made valid here, once, for every field a result message has.
                raw = valid_texts(json.loads(await worker.ask(json.dumps(header).encode(), payload,
                                                              key=header["job_id"])))
            except WorkerFailed as exc:  # raised inside the block: the worker is restarted
                raise RuntimeError(f"sandbox failure: {exc}") from None
        if "error" in raw:  # the job failed, its worker did not (it goes on with the job beside it)
            raise RuntimeError(f"sandbox failure: {raw['error']}")
        result = self._result(raw, bool(job.tests))
        labels = {"outcome": result.violation or ("ok" if result.exit_code == 0 else "exit_nonzero"),
                  "isolation": result.isolation}
        JOB_MS.record(result.duration_ms, labels)
        JOB_CPU.record(result.cpu_user_s + result.cpu_system_s, labels)
        JOB_RSS.record(result.max_rss_bytes, labels)
        return result

    def _result(self, raw: dict, has_tests: bool) -> Result:
        result = Result(
            exit_code=raw["exit_code"], signal=raw["signal"],
            stdout=base64.b64decode(raw["stdout_b64"]), stderr=base64.b64decode(raw["stderr_b64"]),
            stdout_truncated=raw["stdout_truncated"], stderr_truncated=raw["stderr_truncated"],
            tests=raw.get("tests", []), tests_declared=raw.get("tests_declared", []), cpu_user_s=raw["cpu_user_s"], cpu_system_s=raw["cpu_system_s"],
            max_rss_bytes=raw["max_rss_bytes"], usage_source=raw.get("usage_source", "rusage"),
            duration_ms=raw["duration_ms"],
            isolation=self.report.level, missing_guarantees=self.report.missing_guarantees,
            violation=raw["violation"], violation_detail=raw["violation_detail"],
            tamper=raw.get("tamper", []),
        )
        if has_tests and not result.tests:
            # The program ended (or was killed) before the harness could report anything.
            result.tests = [{"name": "tests", "passed": False,
                             "message": result.violation_detail or "no test outcome was reported"}]
        return result

    # --- cgroups ---

    def make_cgroups(self, index: int) -> list[dict[str, str]]:
        """Creates this worker's cgroup slots (SLOTS) with the service's limits; empty ones where the host has none."""
        try:
            return [self._make_slot(f"w{index}{slot}") for slot in SLOTS]
        except OSError as exc:
            for ctrl in ("memory", "pids", "cpu"):
                self.report.missing.setdefault(f"cgroup_{ctrl}", f"could not set up cgroups: {exc}")
            return [{} for _ in SLOTS]

    def make_harness_cgroup(self, index: int) -> dict[str, str]:
        """The cgroup the worker's harnesses share (one per slot, long-lived): what the candidates' replies
        make them hold is charged and bounded here (the service's memory limit, for all of them
        together), not outside every limit; empty where the host has no cgroups."""
        try:
            return self._make_slot(f"w{index}{HARNESS_GROUP}")
        except OSError:
            return {}

    def _make_slot(self, leaf: str) -> dict[str, str]:
        version, controllers = isolation.cgroup_controllers()
        made: dict[str, str] = {}
        if version == 1:
            for ctrl, base in controllers.items():
                path = base / self.runtime_dir.name / leaf
                path.mkdir(parents=True, exist_ok=True)
                self._cgroup_dirs += [path, path.parent]
                made[ctrl] = str(path)
            if "memory" in made:
                _write(Path(made["memory"]) / "memory.limit_in_bytes", self.limits.memory_bytes + (64 << 20))
            if "pids" in made:
                _write(Path(made["pids"]) / "pids.max", self.limits.processes + JAIL_OWN_TASKS)
            if "cpu" in made:
                _write(Path(made["cpu"]) / "cpu.cfs_period_us", 100_000)
                _write(Path(made["cpu"]) / "cpu.cfs_quota_us", 100_000)  # at most one core per job
        elif version == 2 and controllers:
            base = next(iter(controllers.values()))
            parent = base / self.runtime_dir.name
            parent.mkdir(exist_ok=True)
            _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))
            path = parent / leaf
            path.mkdir(exist_ok=True)
            self._cgroup_dirs += [path, parent]
            _write(path / "memory.max", self.limits.memory_bytes + (64 << 20))
            _write(path / "pids.max", self.limits.processes + JAIL_OWN_TASKS)
            _write(path / "cpu.max", "100000 100000")
            made["unified"] = str(path)
        return made


class UidLeases:
    """The uids this pool's workers run jobs as, held by no other sandbox pool on the host: one lock
    file per uid (under /tmp), locked for the pool's life and freed by the kernel if it dies. Two
    sandbox services on one host never share a job uid (a uid names the job in the kernel's log, and
    bounds its processes)."""

    FOLDER = Path("/tmp/crucible-uid-leases")
    SPAN = 65_536  # how far above the base to look

    def __init__(self, base: int, count: int):
        self.FOLDER.mkdir(mode=0o700, exist_ok=True)
        self.uids: list[int] = []
        self._fds: list[int] = []
        uid = base
        while len(self.uids) < count and uid < base + self.SPAN:
            fd = os.open(self.FOLDER / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
            else:
                self.uids.append(uid)
                self._fds.append(fd)
            uid += 1
        if len(self.uids) < count:
            self.release()
            raise RuntimeError(f"no {count} free sandbox uids from {base} (other pools hold them)")

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self.uids = [], []


def sweep_abandoned(tmp: Path = Path("/tmp")) -> int:
    """Removes the cgroup slots and runtime folders of sandbox pools whose process is gone (killed
    before `close`): whatever still runs in such a slot is killed first. How many folders went."""
    _, controllers = isolation.cgroup_controllers()
    bases = set(controllers.values()) | {tmp}
    removed = 0
    for base in bases:
        for folder in base.glob(f"{RUNTIME_PREFIX}*"):
            try:
                owner = int(folder.name[len(RUNTIME_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if owner == os.getpid() or Path(f"/proc/{owner}").exists():
                continue
            if base == tmp:
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
                continue
            leaves = [p for p in folder.rglob("*") if p.is_dir()]
            for leaf in sorted(leaves, key=lambda p: len(p.parts), reverse=True):
                Cgroups({"pids": str(leaf)}).reap()  # any controller's folder lists its processes
                try:
                    leaf.rmdir()
                except OSError:
                    pass
            try:
                folder.rmdir()
                removed += 1
            except OSError:
                pass
    return removed


def _ready(hello: bytes) -> bool:
    return json.loads(hello).get("ready") is True


_JOB_PREFIX = b'{"job_id": '


def _job_of(reply: bytes):
    """The job a worker's reply answers: the supervisor writes its id first (read without parsing the
    whole reply, which may hold megabytes of output)."""
    if reply.startswith(_JOB_PREFIX):
        try:
            return int(reply[len(_JOB_PREFIX):reply.index(b",", len(_JOB_PREFIX))])
        except ValueError:
            pass
    return json.loads(reply).get("job_id")


def _write(path: Path, value) -> None:
    path.write_text(str(value))
