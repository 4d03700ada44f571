"""The jail's root filesystem: a read-only template built once per worker, entered by each job.

The template holds only read-only binds of the interpreter, its standard library
and the shared libraries it loads, a few device nodes and empty mount points;
no /etc, /home, /usr/bin, /proc, and the interpreter's site-packages hidden.
Each cgroup slot has a mount namespace whose root is the template, made once
(`slot_root`); a jail joins its slot's and mounts a fresh tmpfs on /work, so a job
costs one mount, not a copy of the worker's mount tree, a pivot_root and the
detaching of the host's tree. Nothing else in it can change: the template is
read-only, and no job may mount or unmount (seccomp, and no capabilities).
"""
from __future__ import annotations

import errno
import os

from crucible.services.sandbox_executor.jail.linux import (CLONE_NEWNS, MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID,
                                                           MS_PRIVATE, MS_RDONLY, MS_REC, MS_REMOUNT, mount,
                                                           pivot_root, umount_detached, unshare)

_READONLY_BIND = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV


def build_template(cfg: dict) -> None:
    """Moves the worker into a mount namespace of its own and builds the template at cfg["root_dir"]."""
    root = cfg["root_dir"]
    unshare(CLONE_NEWNS, "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("jail", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for path in cfg["ro_binds"]:
        target = root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        mount(path, target, None, MS_BIND | MS_REC)
        mount(None, target, None, _READONLY_BIND)
    for path in cfg["hidden"]:  # e.g. the interpreter's site-packages: an empty read-only tmpfs over it
        target = root + path
        if os.path.isdir(target):
            mount("hidden", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    for link, dest in cfg["symlinks"].items():
        os.makedirs(os.path.dirname(root + link), exist_ok=True)
        os.symlink(dest, root + link)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("null", "zero", "urandom", "random"):
        open(f"{root}/dev/{dev}", "a").close()
        mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
        mount(None, f"{root}/dev/{dev}", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/work")
    os.makedirs(root + "/.old")
    # Scratch space is the job's own tmpfs: /tmp, and /dev/shm, where POSIX semaphores and shared memory
    # live (multiprocessing's locks and queues need them).
    os.symlink("/work", root + "/tmp")
    os.symlink("/work", root + "/dev/shm")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def slot_root(cfg: dict) -> None:
    """Moves this process into a new mount namespace whose root is the template (pivot_root, the
    host's tree detached for good): a slot's, made once. The caller holds it by a descriptor opened
    before this (the template has no /proc) and returns to its own namespace with setns."""
    os.chdir(cfg["root_dir"])
    pivot_root(b".", b".old")
    os.chdir("/")
    umount_detached(b"/.old")


def enter(cfg: dict) -> None:
    """In the slot's mount namespace (already joined): a fresh private size-capped tmpfs on /work, in
    place of the one the slot's last job had (its processes are gone: the slot was emptied)."""
    try:
        umount_detached(b"/work")
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: nothing mounted there yet (the slot's first job)
            raise
    mount("work", "/work", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={cfg['work_bytes']},nr_inodes=4096,mode=0700,uid={cfg['uid']},gid={cfg['uid']}")
    os.chdir("/work")
