"""Crucible's services as processes on this machine: started, watched, started again when one dies.

One `Services` keeps a set of them (a run's, under `crucible train`, or the standing deployment of
`crucible up`): each logs to <folder>/logs/<name>.log and writes its metrics port to
<folder>/metrics/<name>.port; <folder>/services.json names the live process of each, for
operators and for a resumed run, which stops what an interrupted one left running.

A service that exits is started again after a backoff of 1, 2, 4, ... s (at most MAX_BACKOFF_S);
its state is on the log and in checkpoints, so the work goes on. The backoff starts over once a
service has stayed up for SETTLED_S. With `max_restarts`, a service that dies that many times in
a row raises ServiceFailed with its log's tail.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from crucible.shared.procs import pid_alive, stop_processes

SERVICES = ("control", "sandbox_executor", "verifier", "reward_aggregator", "learner", "generator", "evaluator")
MAX_BACKOFF_S = 60.0
SETTLED_S = 60.0


# The services that run torch, on one machine: torch's default of one OpenMP thread a core, in each of
# three processes, puts more threads than cores on the CPU, and they spin against each other. The
# samplers (generator, evaluator) take half the cores, the learner the other half: asynchronous, the
# learner steps while the generator samples the next batch. On two cores the learner's second thread
# cost more CPU than it saved time (crucible train, built-in recipe, 40 steps: 812 and 758 ms of CPU a
# step with two threads, 742 and 717 with one; a step 428 and 409 ms against 394 and 378).
SAMPLERS = ("generator", "evaluator")


def torch_threads(name: str, env: dict[str, str], cores: int | None = None) -> dict[str, str]:
    """The OpenMP threads of a torch service here (a sampler half the cores, the learner the rest, at
    least one each); none for other services, or where the environment already says how many."""
    if name not in (*SAMPLERS, "learner") or "OMP_NUM_THREADS" in env:
        return {}
    cores = cores or len(os.sched_getaffinity(0))
    half = cores // 2
    return {"OMP_NUM_THREADS": str(max(1, half if name in SAMPLERS else cores - half))}


# Work no policy step waits for runs below normal CPU priority (Settings.cpu_nice), taking the CPU the
# step's path (generator, sandbox, verifier, aggregator, learner, broker, store) leaves: the evaluator,
# which scores held-out splits beside the training. Built-in recipe, eval every 10 versions, 40 steps,
# 16 alternated pairs of `crucible train`: the median time between versions lower with the evaluator at
# nice 15 than at 0 in 13, by about 7% at the median (nice 5: in between). The store and control at
# nice 10 as well were slower in 6 of 6 pairs (the learner's hand-over and the aggregator wait for rows).
BACKGROUND = {"evaluator": 15}


def cpu_priority(name: str, env: dict[str, str]) -> dict[str, str]:
    """The nice value of a background service here; none for others, or where the environment already sets one."""
    if name not in BACKGROUND or "CRUCIBLE_CPU_NICE" in env:
        return {}
    return {"CRUCIBLE_CPU_NICE": str(BACKGROUND[name])}


class ServiceFailed(RuntimeError):
    """A service kept dying; the text has its exit code and the tail of its log."""


class Services:
    def __init__(self, folder: Path, env: dict[str, str], echo=print, max_restarts: int | None = 5):
        self.folder, self.env, self.echo, self.max_restarts = folder, env, echo, max_restarts
        self.processes: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}
        self.failures: dict[str, int] = {}       # service -> restarts since it last stayed up SETTLED_S
        self.restarts: dict[str, int] = {}       # service -> restarts in all
        self.restart_at: dict[str, float] = {}   # service -> not before (monotonic)
        self._held = None  # the folder's lock file, while this runs services
        self._tag = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:8]  # this folder, in instance ids

    def log_file(self, name: str) -> Path:
        return self.folder / "logs" / f"{name}.log"

    def metrics_port_file(self, name: str) -> Path:
        """Where service `name` writes the port of its Prometheus /metrics endpoint."""
        return self.folder / "metrics" / f"{name}.port"

    def claim(self) -> None:
        """Held while this Services runs anything: a second supervisor of the same folder (a second
        `crucible up`, a `--resume` of a run still going) would fight this one over every service."""
        if self._held is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        held = open(self.folder / "services.lock", "w")
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.close()
            raise ServiceFailed(f"another Crucible process runs the services of {self.folder}; stop it first") from None
        self._held = held

    def start(self, name: str) -> None:
        """Starts (or starts again) one service as a process."""
        self.claim()
        self.restart_at.pop(name, None)
        self.log_file(name).parent.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", f"crucible.services.{name}"]
        if name == "learner":  # one process, or its ranks under torchrun
            from crucible.services.learner.ranks import launch_args  # (imports torch: only where it is needed)

            args = launch_args(int(self.env.get("CRUCIBLE_LEARNER_RANKS", "1")))
        if name == "sandbox_executor" and os.geteuid() != 0:
            args.append("--allow-weak-isolation")  # not root: results name what is missing
        env = {**self.env, "CRUCIBLE_METRICS_PORT": "0",  # any free port, written to the port file
               "CRUCIBLE_METRICS_PORT_FILE": str(self.metrics_port_file(name)),
               # one instance of each service per folder, the same across its restarts: static membership
               "CRUCIBLE_INSTANCE_ID": f"{socket.gethostname()}-{self._tag}-{name}"}
        env.update(torch_threads(name, self.env))
        env.update(cpu_priority(name, self.env))
        with open(self.log_file(name), "ab") as log:
            self.processes[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL)
        self.started_at[name] = time.monotonic()
        self._record()

    def start_all(self, names: tuple[str, ...] = SERVICES) -> None:
        for name in names:
            self.start(name)

    def check(self) -> list[str]:
        """Starts again every service that exited and whose backoff has passed; returns their names."""
        now = time.monotonic()
        started = []
        for name, proc in list(self.processes.items()):
            if proc.poll() is None:
                if now - self.started_at[name] >= SETTLED_S:
                    self.failures[name] = 0
                continue
            failures = self.failures.get(name, 0)
            if self.max_restarts is not None and failures >= self.max_restarts:
                tail = self.log_file(name).read_text(errors="replace").splitlines()[-15:]
                raise ServiceFailed(f"service {name} exited with {proc.returncode} after {failures} restarts:\n"
                                    + "\n".join(tail))
            if name not in self.restart_at:
                self.restart_at[name] = now + min(2.0 ** failures, MAX_BACKOFF_S) - 1  # the first at once
                self.echo(f"      service {name} exited with {proc.returncode}; starting it again"
                          + (f" in {self.restart_at[name] - now:.0f}s" if self.restart_at[name] > now else ""))
            if now < self.restart_at[name]:
                continue
            del self.restart_at[name]
            self.failures[name] = failures + 1
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self.start(name)
            started.append(name)
        return started

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time each running service (with its child processes) has used so far."""
        return cpu_seconds({name: proc.pid for name, proc in self.processes.items() if proc.poll() is None})

    def stop(self, timeout: float = 20.0) -> None:
        stop_processes(list(self.processes.values()), timeout=timeout)
        self._record()
        if self._held is not None:
            self._held.close()
            self._held = None

    def _record(self) -> None:
        live = {name: proc.pid for name, proc in self.processes.items() if proc.poll() is None}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "services.json").write_text(json.dumps(live, indent=1))


def cpu_seconds(pids: dict[str, int | None]) -> dict[str, float]:
    """User plus system CPU seconds used so far by each named process and all its descendants (those
    still running and those already reaped); a process that is gone counts nothing."""
    import psutil

    used = {}
    for name, pid in pids.items():
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        total = 0.0
        for proc in tree:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue  # ended between the listing and now
            total += t.user + t.system + t.children_user + t.children_system
        used[name] = total
    return used


def listener_pid(address: str) -> int | None:
    """The pid of the process on this machine that listens on `address`'s port (host:port or a URL), if any."""
    import psutil
    from urllib.parse import urlsplit

    port = urlsplit(address if "://" in address else f"//{address.split(',')[0]}").port
    if port is None:
        return None
    try:
        return next((c.pid for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid), None)
    except psutil.Error:
        return None


def recorded(folder: Path) -> dict[str, int]:
    """The services `folder/services.json` names that still run (their command line says so)."""
    try:
        named = json.loads((folder / "services.json").read_text())
    except (OSError, ValueError):
        return {}
    alive = {}
    mine = f"CRUCIBLE_METRICS_PORT_FILE={folder}/".encode()  # set for each service started from `folder`
    for name, pid in named.items():
        try:
            cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
            environ = Path(f"/proc/{int(pid)}/environ").read_bytes()
        except (OSError, ValueError):
            continue
        if f"crucible.services.{name}".encode() in cmdline and mine in environ and pid_alive(int(pid)):
            alive[name] = int(pid)
    return alive


def stop_recorded(folder: Path, timeout: float = 20.0) -> list[str]:
    """Stops what an earlier Services in `folder` left running (a `crucible train` that was killed)."""
    alive = recorded(folder)
    stop_processes(list(alive.values()), timeout=timeout)
    return sorted(alive)
