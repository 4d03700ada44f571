"""The jail's root filesystem: a read-only template built once per worker, entered by each job.

The template holds only read-only binds of the interpreter's standard library
and the shared libraries it loads, a few device nodes and empty mount points;
no /etc, /home, /usr/bin, /proc, and the interpreter's site-packages hidden.
Each job's mount namespace is a copy of the worker's, so a job costs one tmpfs
mount and a pivot_root, not a dozen mounts.
"""
from __future__ import annotations

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
    os.symlink("/work", root + "/tmp")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter(cfg: dict) -> None:
    """In the job's fresh mount namespace: a private size-capped tmpfs /work, then pivot into the
    template; the host's tree is detached for good."""
    root = cfg["root_dir"]
    unshare(CLONE_NEWNS, "unshare(CLONE_NEWNS)")
    mount("work", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={cfg['work_bytes']},nr_inodes=4096,mode=0700,uid={cfg['uid']},gid={cfg['uid']}")
    os.chdir(root)
    pivot_root(b".", b".old")
    os.chdir("/")
    umount_detached(b"/.old")
    os.chdir("/work")
