"""The zygote: the worker's fork server. It forks each jail, and never holds a job.

    supervisor (the worker's own process: reads jobs, runs them, sends results; supervisor.py)
    zygote     (this module: forked from it before any job existed)
      ├─ jail     (jailed.py; pid 1 of fresh namespaces; one job, a tested job's candidate)
      └─ harness  (jailed.run_harness; a slot's, runs its tested jobs' tests: harness.serve)

Every jail is a fork of this process, so whatever this process's memory holds,
every job's memory holds too. It therefore never reads a job, a test or a
result: the supervisor asks it for a jail over a Unix socket, and it answers
with the jail's pid and the supervisor's ends of the jail's pipes (passed as
descriptors, keeping none), and later with the jail's exit status and usage
once it has reaped it. It exits when the supervisor closes the socket, and
dies with the supervisor (parent-death signal).

Each cgroup slot has a network, a UTS and a mount namespace of its own, made here once: a jail
joins its slot's instead of making three and destroying them (a network namespace alone was about
a twentieth of a job's CPU). They hold nothing a job could leave behind: the network namespace has
only its loopback device, down, which no job may configure (no capabilities), and the sockets a
job can make (AF_UNIX only, seccomp.py) end with its processes, which all end before the slot takes
another job (supervisor.py); the mount namespace's root is the read-only template, and each jail
mounts a fresh /work over its predecessor's (rootfs.py). Jobs in other slots, running at the same
time, are in other namespaces. The IPC namespace is made fresh per jail: System V objects outlive
their makers.
"""
from __future__ import annotations

import os
import _socket
import select
import signal

from crucible.services.sandbox_executor import candidate
from crucible.services.sandbox_executor.jail import jailed, rootfs
from crucible.services.sandbox_executor.jail.linux import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID,
                                                           CLONE_NEWUTS, PR_SET_PDEATHSIG, prctl, send_fds, set_hostname,
                                                           setns, unshare)

# The order of the descriptors passed with each prepared jail (the supervisor reads them by name).
PASSED = ("pidfd", "job_w", "in_w", "out_r", "err_r", "call_w", "reply_r", "ready_r", "attached_w", "calls")
# The same for a prepared harness (harness.serve): the supervisor's end of its control socket.
PASSED_HARNESS = ("pidfd", "control", "ready_r", "attached_w", "calls")
MESSAGE_BYTES = 4096


def start(cfg: dict) -> tuple[int, _socket.socket]:
    """Forks the zygote; returns its pid and the supervisor's end of its socket."""
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ours.close()
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")
            # Never the pool's pipes: the zygote reads no job and writes no result.
            null = os.open("/dev/null", os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.close(null)
            candidate.leave_host()
            serve(cfg, theirs)
        except BaseException as exc:
            try:
                os.write(2, f"sandbox zygote failed: {type(exc).__name__}: {exc}\n".encode())
            except OSError:
                pass
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return pid, ours


def serve(cfg: dict, channel: _socket.socket) -> None:
    """Prepares a jail per request (`prepare <slot>`); reports each jail's end once reaped; returns when
    the channel closes."""
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY) if cfg["isolate"] else -1
    slots = len(cfg.get("cgroups") or [{}, {}, {}])
    shared = slot_namespaces(cfg, slots) if cfg["isolate"] else [()] * slots
    kept = [fd for fds in shared for fd in fds]
    slot_configs = [slot_config(cfg, slot) for slot in range(slots)]
    # Every jail is a fork of this process, and a job can read whatever Python holds here (the stack's
    # frames, gc.get_objects()): the worker's configuration (runtime folder, cgroup paths, checkout and
    # bind paths, every slot's uid) goes now that the slots are made. It is one dict, the worker's
    # CONFIG and every frame's `cfg` alike: emptied in place, in this process only.
    cfg.clear()
    live: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([channel.fileno(), *live], [], [])
        for pidfd in [fd for fd in readable if fd in live]:
            pid = live.pop(pidfd)
            _, status, usage = os.wait4(pid, 0)
            os.close(pidfd)
            channel.send(b"exit %d %d %r %r %d" % (pid, status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss * 1024))
        if channel.fileno() in readable:
            request = channel.recv(MESSAGE_BYTES)
            if not request:
                return
            kind, slot = request.split()
            fork = fork_jail if kind == b"prepare" else fork_harness
            pid, passed = fork(slot_configs[int(slot)], own_pid_ns, shared[int(slot)], [channel.fileno(), *live, *kept])
            live[os.dup(passed["pidfd"])] = pid
            send_fds(channel, b"prepared %d" % pid,
                     [passed[name] for name in (PASSED if kind == b"prepare" else PASSED_HARNESS)])
            for fd in passed.values():
                os.close(fd)


SLOT_NAMESPACES = (("net", CLONE_NEWNET), ("uts", CLONE_NEWUTS), ("mnt", CLONE_NEWNS))


# What a slot's jails and harness read of the worker's configuration (jailed.py, rootfs.enter): nothing
# of the host (no path, no other slot's uid), since the job's process holds it.
SLOT_KEYS = ("isolate", "seccomp", "work_bytes", "harness_memory_bytes")


def slot_config(cfg: dict, slot: int) -> dict:
    """What a slot's jails and harness are forked with: SLOT_KEYS, the slot's own uid (jobs running at
    once never share one), whether the job's process count is a pids cgroup's (jailed.set_limits), and
    without namespaces a folder of the slot's own for its jobs' files, the uid's (a weak sandbox, whose
    jobs run in the host's tree anyway)."""
    slot_cfg = {key: cfg[key] for key in SLOT_KEYS}
    slot_cfg["uid"] = cfg["uids"][slot]
    slot_cfg["pids_cgroup"] = any("pids" in paths or "unified" in paths for paths in cfg.get("cgroups") or [{}])
    if not cfg["isolate"]:
        slot_cfg["work_dir"] = os.path.join(cfg["root_dir"], f"slot{slot}")
        os.makedirs(slot_cfg["work_dir"], mode=0o700, exist_ok=True)
        if os.geteuid() == 0:  # the job's files are written after the uid drop, by the slot's uid
            os.chown(slot_cfg["work_dir"], slot_cfg["uid"], slot_cfg["uid"])
    return slot_cfg


def slot_namespaces(cfg: dict, count: int) -> list[tuple[int, ...]]:
    """Descriptors of each of `count` slots' namespaces (SLOT_NAMESPACES' order): the hostname set,
    the root the template; this process stays in its own."""
    own = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind, _ in SLOT_NAMESPACES]
    made = []
    try:
        for _ in range(count):
            unshare(CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWNS, "unshare(slot net, uts, mnt)")
            set_hostname(b"sandbox")
            made.append(tuple(os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind, _ in SLOT_NAMESPACES))
            rootfs.slot_root(cfg)
            for fd, (kind, flag) in zip(own, SLOT_NAMESPACES):  # back, for the next slot's copy
                setns(fd, flag, f"setns(own {kind} namespace)")
    finally:
        for fd, (kind, flag) in zip(own, SLOT_NAMESPACES):
            setns(fd, flag, f"setns(own {kind} namespace)")
            os.close(fd)
    return made


def fork_jail(cfg: dict, own_pid_ns: int, slot_ns: tuple, close_in_child: list[int]) -> tuple[int, dict]:
    """Forks a jail (jailed.run) as pid 1 of a fresh pid namespace, in its slot's network, UTS and mount
    namespaces (`slot_ns`) and a fresh IPC one; (its pid, the descriptors for the supervisor).
    For a tested job the jail is the candidate's process: its call channel's other ends (call_w,
    reply_r) go to the slot's harness, by way of the supervisor."""
    job_r, job_w = os.pipe()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    theirs = {"job_w": job_w, "in_w": in_w, "out_r": out_r, "err_r": err_r, "call_w": call_w, "reply_r": reply_r}
    ours = (job_r, in_r, out_w, err_w, call_r, reply_w)
    return _fork(cfg, own_pid_ns, slot_ns, close_in_child, theirs, ours, jailed.run, SLOT_NAMESPACES)


def fork_harness(cfg: dict, own_pid_ns: int, slot_ns: tuple, close_in_child: list[int]) -> tuple[int, dict]:
    """Forks a slot's harness (jailed.run_harness): confined as a jail is, in a pid namespace of its own,
    it runs the tests of the slot's tested jobs one after another (harness.serve); the candidate's
    process of each is the job's jail. Its control socket carries each job's tests and call channel."""
    control, control_theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    # Only the slot's mount namespace (the harness sees each job's /work, as the job's process does);
    # network and UTS namespaces of its own: nothing it makes in them outlives it, and no job reaches them.
    return _fork(cfg, own_pid_ns, slot_ns[2:], close_in_child, {"control": control.detach()},
                 (control_theirs.detach(),), jailed.run_harness, SLOT_NAMESPACES[2:], CLONE_NEWNET | CLONE_NEWUTS)


def _fork(cfg: dict, own_pid_ns: int, slot_ns: tuple, close_in_child: list[int], theirs: dict[str, int],
          ours: tuple[int, ...], main, joined: tuple, fresh: int = 0) -> tuple[int, dict]:
    """Forks `main(cfg, *ours, ready_w, attached_r, calls_w)` in fresh pid and ipc namespaces (and
    `fresh` ones), joining the slot's `joined` (slot_ns holds their descriptors); `theirs` (the
    supervisor's ends) close in it, `ours` here."""
    ready_r, ready_w = os.pipe()
    attached_r, attached_w = os.pipe()
    # Seccomp listeners come in here (the C-level pair: no Python socket objects made and dropped per jail).
    calls, calls_w = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    if cfg["isolate"]:
        # A process may unshare its children's pid namespace once; joining its own again first
        # lets it do so for every jail. The other namespaces the jail joins or makes itself.
        setns(own_pid_ns, CLONE_NEWPID, "setns(own pid namespace)")
        unshare(CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        try:
            if cfg["isolate"]:
                for fd, (kind, flag) in zip(slot_ns, joined):
                    setns(fd, flag, f"setns(slot {kind} namespace)")
                unshare(CLONE_NEWIPC | fresh, "unshare(CLONE_NEWIPC)")
                if fresh & CLONE_NEWUTS:
                    set_hostname(b"sandbox")
        except BaseException as exc:  # never back into the zygote's loop
            os.write(2, f"sandbox setup failed: {exc}\n".encode())
            os._exit(121)
        for fd in (*theirs.values(), ready_r, attached_w, *close_in_child):
            os.close(fd)
        if own_pid_ns >= 0:
            os.close(own_pid_ns)
        calls.close()
        main(cfg, *ours, ready_w, attached_r, calls_w.detach())
    for fd in (*ours, ready_w, attached_r):
        os.close(fd)
    calls_w.close()
    return pid, {"pidfd": os.pidfd_open(pid), **theirs, "ready_r": ready_r, "attached_w": attached_w,
                 "calls": calls.detach()}

