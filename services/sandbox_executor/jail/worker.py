"""The worker loop: a long-lived fork server that never reads job code, keeping one supervisor ready.

    worker (this loop, root)
      └─ supervisor  (one per job, supervisor.py)
           └─ jail   (jailed.py; for a tested job the harness, with the candidate's process beside it)

The next supervisor, its jail and the jail's candidate process are forked and
set up (namespaces, root, cgroups) while the current job runs, so a job's
latency holds no fork, unshare or mount. Each worker has three cgroup slots:
the prepared jail sits in one, the running job fills another, the last job's
teardown (after its result was sent) empties the third.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import time

from crucible.services.sandbox_executor import candidate
from crucible.services.sandbox_executor.jail import rootfs, seccomp, supervisor
from crucible.services.sandbox_executor.jail.cgroups import Cgroups
from crucible.shared import framing

BACKSTOP_S = 10  # past a job's wall clock, the worker kills a supervisor that has not finished it


def main(cfg: dict) -> None:
    """Builds what every job inherits through fork, says ready on stdout, then serves until stdin closes."""
    slots = [Cgroups(paths) for paths in cfg.get("cgroups") or [{}, {}, {}]]
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
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    framing.write(1, json.dumps({"ready": True, "pid": os.getpid(), "calls_named": seccomp.NOTIFY}).encode())
    serve(cfg, slots)


def spawn_supervisor(cfg: dict, slots: list[Cgroups], slot: int) -> dict:
    notify_r, notify_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(notify_r)
        supervisor.supervise(cfg, slots[slot], notify_w)
    os.close(notify_w)
    return {"pid": pid, "pidfd": os.pidfd_open(pid), "notify_r": notify_r, "job_id": None, "deadline": None,
            "slot": slot}


def serve(cfg: dict, slots: list[Cgroups]) -> None:
    """Always one supervisor prepared and waiting; the next is forked as soon as the current one
    has taken its job, so jail set-up overlaps the previous job's run.

    Each supervisor takes a cgroup slot no other live supervisor holds. A supervisor sends its
    result before it has torn its jail down, so with three slots the next jail is prepared in a
    free one while the last job's teardown finishes in its own (and the running job fills the
    third); if none is free, preparing waits until one is.
    """
    waiting: dict | None = spawn_supervisor(cfg, slots, 0)
    running: list[dict] = []
    while True:
        if waiting is None:
            busy = {r["slot"] for r in running}
            free = [i for i in range(len(slots)) if i not in busy]
            if free:
                waiting = spawn_supervisor(cfg, slots, free[0])
        watched = [r["pidfd"] for r in running] + [r["notify_r"] for r in running if r["notify_r"] >= 0]
        if waiting is not None:
            watched += [waiting["notify_r"], waiting["pidfd"]]
        deadlines = [r["deadline"] for r in running]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        readable, _, _ = select.select(watched, [], [], timeout)
        if waiting is not None and waiting["notify_r"] in readable:
            note = os.read(waiting["notify_r"], 4096)
            if note:
                info = json.loads(note.split(b"\n")[0])
                # The supervisor enforces the wall clock; this is the backstop if it hangs.
                waiting.update(job_id=info["job_id"], deadline=time.monotonic() + info["wall_s"] + BACKSTOP_S,
                               sent=b"sent\n" in note)
                running.append(waiting)
                waiting = None
                continue
        if waiting is not None and waiting["pidfd"] in readable:  # died before taking a job
            _, status = os.waitpid(waiting["pid"], 0)
            os.close(waiting["pidfd"])
            os.close(waiting["notify_r"])
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == supervisor.SHUT_DOWN:
                for r in running:
                    os.waitpid(r["pid"], 0)
                return  # stdin closed: the pool is shutting us down
            waiting = None
        now = time.monotonic()
        for r in list(running):
            if r["notify_r"] in readable:
                note = os.read(r["notify_r"], 4096)
                r["sent"] = r["sent"] or b"sent\n" in note
                if not note:
                    os.close(r["notify_r"])
                    r["notify_r"] = -1
            if r["pidfd"] in readable or now > r["deadline"]:
                if r["pidfd"] not in readable:
                    os.kill(r["pid"], signal.SIGKILL)
                _, status = os.waitpid(r["pid"], 0)
                os.close(r["pidfd"])
                if r["notify_r"] >= 0:
                    r["sent"] = r["sent"] or b"sent\n" in _read_all(r["notify_r"])
                    os.close(r["notify_r"])
                running.remove(r)
                died = os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == supervisor.RESULT_LOST
                if died and not r["sent"]:
                    framing.write(1, json.dumps({"job_id": r["job_id"], "error": "the job's supervisor died"}).encode())


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)
