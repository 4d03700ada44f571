"""What this host can enforce: probed once at start, reported at start and in every result."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# Every guarantee full isolation gives, by name; a missing one is reported as such.
GUARANTEES = ("linux", "root_for_namespaces", "namespaces", "seccomp", "cgroup_memory", "cgroup_pids",
              "cgroup_cpu", "readonly_root")


class IsolationError(RuntimeError):
    """Full isolation is not available and weaker isolation was not explicitly allowed."""


@dataclass
class IsolationReport:
    missing: dict[str, str] = field(default_factory=dict)  # guarantee -> why it is missing
    cgroup_version: int | None = None

    @property
    def level(self) -> str:
        if not self.missing:
            return "full"
        if "namespaces" in self.missing or "linux" in self.missing:
            return "none"
        return "partial"

    @property
    def missing_guarantees(self) -> list[str]:
        return [f"{name}: {why}" for name, why in self.missing.items()]

    def describe(self) -> str:
        if not self.missing:
            return "full isolation: namespaces (pid, mount, net, ipc, uts), read-only tmpfs root, seccomp, " \
                   f"rlimits, cgroup v{self.cgroup_version} memory/pids/cpu"
        return f"{self.level} isolation; missing: " + "; ".join(self.missing_guarantees)


def interpreter_prefix() -> Path:
    return Path(sys.base_prefix)


def base_python() -> str:
    """The real interpreter behind any virtual environment (the jail sees no venv)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (interpreter_prefix() / "bin" / version, Path(getattr(sys, "_base_executable", ""))):
        if candidate.is_file():
            return str(candidate)
    return sys.executable


def readonly_binds() -> tuple[list[str], list[str], dict[str, str]]:
    """(paths bound read-only, paths hidden under an empty tmpfs, symlinks) that make up the jail's root.

    Only the interpreter (a program may start it again: `subprocess.run([sys.executable, ...])`, the
    resource tracker of multiprocessing's shared memory), its standard library and the shared libraries
    it loads: no /etc, no /home, no /usr/bin, no site-packages.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    libdir = sysconfig.get_config_var("LIBDIR") or str(interpreter_prefix() / "lib")
    binds = [base_python(), stdlib]
    for lib in Path(libdir).glob("libpython*.so*"):
        binds.append(str(lib))
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    for d in (f"/lib/{multiarch}", f"/usr/lib/{multiarch}", "/lib64", "/usr/lib64"):
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in binds:
            binds.append(real)
    if os.path.exists("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    # The base interpreter's own site-packages sits inside the standard library folder.
    hidden = [str(Path(stdlib) / "site-packages")] if (Path(stdlib) / "site-packages").is_dir() else []
    symlinks = {}
    for link in ("/lib64", "/lib", "/bin"):
        if os.path.islink(link):
            symlinks[link] = os.readlink(link)
    # /lib64 -> usr/lib64 style links need their target bound too, which the loop above did via realpath.
    return binds, hidden, symlinks


def probe(cgroup_root: Path = Path("/sys/fs/cgroup")) -> IsolationReport:
    report = IsolationReport()
    if sys.platform != "linux":
        for g in GUARANTEES:
            report.missing[g] = f"not Linux ({sys.platform})"
        return report
    if os.geteuid() != 0:
        report.missing["root_for_namespaces"] = "not running as root: mount/pid/net namespaces and the " \
                                                "tmpfs root need CAP_SYS_ADMIN"
        report.missing["namespaces"] = "needs root"
        report.missing["readonly_root"] = "needs mount namespaces"
    else:
        check = subprocess.run(["unshare", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "true"],
                               capture_output=True, text=True)
        if check.returncode != 0:
            report.missing["namespaces"] = f"unshare failed: {check.stderr.strip()[:200]}"
            report.missing["readonly_root"] = "needs mount namespaces"
    if platform.machine() != "x86_64":
        report.missing["seccomp"] = f"the seccomp filter is written for x86_64, not {platform.machine()}"
    elif not _seccomp_supported():
        report.missing["seccomp"] = "the kernel does not offer seccomp filters"
    version, controllers = cgroup_controllers(cgroup_root)
    report.cgroup_version = version
    for ctrl in ("memory", "pids", "cpu"):
        if ctrl not in controllers:
            report.missing[f"cgroup_{ctrl}"] = f"no writable {ctrl} cgroup controller " + \
                                               ("(no cgroups)" if version is None else f"(cgroup v{version})")
    return report


def _seccomp_supported() -> bool:
    try:
        return "Seccomp:" in Path("/proc/self/status").read_text()
    except OSError:
        return False


def cgroup_controllers(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, dict[str, Path]]:
    """(version, controller -> directory we may create children in) for this host."""
    if os.geteuid() != 0:
        return None, {}
    if (root / "cgroup.controllers").exists():  # a pure v2 hierarchy
        own = _own_v2_path(root)
        available = (own / "cgroup.controllers").read_text().split() if (own / "cgroup.controllers").exists() else []
        return 2, {c: own for c in ("memory", "pids", "cpu") if c in available}
    found = {}
    for ctrl in ("memory", "pids", "cpu", "cpuacct"):  # cpuacct: accounting only (a job's CPU time)
        path = root / ctrl
        if (path / "cgroup.procs").exists() and os.access(path, os.W_OK):
            found[ctrl] = path
    return (1 if found else None), found


def _own_v2_path(root: Path) -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root
