"""The worker: builds what every jail inherits, forks the zygote, then supervises jobs until stdin closes.

    worker   (root; after start-up the supervisor: supervisor.py)
    └─ zygote  (zygote.py: forks jails and harnesses, never holds a job)
         ├─ jail     (jailed.py: one job; a tested job's candidate process)
         └─ harness  (jailed.run_harness: one per cgroup slot, runs the slot's tested jobs' tests)

The next jail is forked and set up (namespaces, root, cgroups) while the current
job runs, so a job's latency holds no fork, unshare or mount. Each worker has five
cgroup slots (pool.SLOTS): the prepared jail sits in one, each of the two jobs it
takes at once fills one, and each job's teardown (after its result was sent) empties
its own.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys

from crucible.services.sandbox_executor import candidate
from crucible.services.sandbox_executor.jail import jailed, linux, rootfs, seccomp, zygote
from crucible.services.sandbox_executor.jail.cgroups import Cgroups
from crucible.shared import framing


def main(cfg: dict) -> None:
    """Builds what every job inherits through fork, says ready on stdout, then serves until stdin closes."""
    if cfg.get("cpus"):  # pool.worker_cpus: before the zygote, so that every process of the worker inherits it
        try:
            os.sched_setaffinity(0, cfg["cpus"])
        except OSError:  # (a CPU taken away since the pool looked): the worker runs where the scheduler puts it
            pass
    if cfg["isolate"]:
        rootfs.build_template(cfg)
    if cfg["seccomp"]:
        seccomp.prepare(seccomp.notify_supported())
    # Modules imported here are inherited by every job through fork, so a job
    # that imports typing or re does not pay for it again (zygote preloading).
    for name in cfg.get("preload", ()):
        try:
            __import__(name)
        except ImportError:
            pass
    candidate.prepare()
    # Every job's environment, inherited through fork: exactly JOB_ENVIRONMENT (the interpreter's own
    # start-up may have added LC_CTYPE to the empty one the worker was given).
    os.environ.clear()
    os.environ.update(jailed.JOB_ENVIRONMENT)
    # A full collection, then every object moves to the permanent generation, which no job's
    # collection walks (a walk would write to, and so copy, every page of it). The collection also
    # stops tracking what holds only atoms (the tuples of constants of the worker's own code, whose
    # strings name configuration keys): a job's gc.get_objects() sees none of them, however many
    # collections the imports before happened to run.
    gc.collect()
    gc.freeze()
    # What start-up allocated and freed (compiling the worker's modules, building the template, reading
    # the configuration) leaves free pages in the C heap, still mapped: ~0.9 MB of the zygote's ~7.7 MB
    # of anonymous memory, copied into every jail's page tables. They go back to the kernel.
    linux.release_free_heap()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # The zygote is forked now, before this process has read any job or started a thread, and before
    # it has imported `threading`: a process that has registers a handler every fork runs in the child
    # (threading._after_fork), never run in the zygote itself, so cold: about 120 copied pages and half a
    # millisecond in every jail and every candidate. The supervisor's threads come after.
    assert "threading" not in sys.modules, "imported before the zygote: every jail would pay for it"
    forked = zygote.start(cfg)
    # The supervisor's hold on its slots' cgroups (paths, open control files): made after the zygote,
    # which never has them, so no jail does either.
    slots = [Cgroups(paths, keep_open=True) for paths in cfg.get("cgroups") or [{}, {}, {}]]
    from crucible.services.sandbox_executor.jail import supervisor

    link = supervisor.Zygote(*forked)
    framing.write(1, json.dumps({"ready": True, "pid": os.getpid(), "calls_named": seccomp.NOTIFY}).encode())
    try:
        supervisor.Supervisor(cfg, slots, link).serve()
    finally:
        link.close()
