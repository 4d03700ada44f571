"""A sandbox worker's main module, run by the bootstrap in pool.py (`python -I -S -B -c BOOT`).

The configuration (host paths, cgroup slots, uid, ...) arrives on stdin, never on the command line:
a job can read `sys.orig_argv` and `/proc/self/cmdline`, and must find nothing of the host there.
The bootstrap reads it and runs this file with it as `CONFIG`.

With `-I -S` the installed `crucible` package cannot be imported the usual way (an install lives in
site-packages, an editable one is found through it). The pool passes, in `CONFIG["packages"]`, the
folders of the two packages the worker runs from: crucible.shared (framing, tamper pattern names, test_report)
and crucible.services.sandbox_executor. `JailFinder` imports their modules from those folders under
neutral names (`/crucible/...`): a job's traceback or a module's `__file__` shows no host path.
No package's `__init__` runs (the worker imports nothing beyond the standard library, and only the
modules it names).
"""
import importlib.util
import os
import sys
import types

NEUTRAL_ROOT = "/crucible"


class JailFinder:
    """Finds the registered packages' modules in their real folders and compiles them under neutral
    file names; no bytecode cache is read or written."""

    def __init__(self, roots: dict[str, str]):
        self.roots = roots  # package name -> its folder

    def find_spec(self, fullname, path=None, target=None):
        for root, folder in self.roots.items():
            if not fullname.startswith(root + "."):
                continue
            real = os.path.join(folder, *fullname[len(root) + 1:].split("."))
            neutral = NEUTRAL_ROOT + "/" + "/".join(fullname.split(".")[1:])
            for source, shown, package in ((os.path.join(real, "__init__.py"), neutral + "/__init__.py", True),
                                           (real + ".py", neutral + ".py", False)):
                if os.path.isfile(source):
                    spec = importlib.util.spec_from_loader(fullname, NeutralLoader(source, shown), origin=shown,
                                                           is_package=package)
                    spec.has_location = True
                    if package:
                        spec.submodule_search_locations = [neutral]
                    return spec
        return None


class NeutralLoader:
    def __init__(self, source: str, shown: str):
        self.source, self.shown = source, shown

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self.source, "rb") as f:
            code = compile(f.read(), self.shown, "exec", dont_inherit=True)
        self.source = self.shown  # the module's __loader__ and __spec__ hold this loader: no host path there
        exec(code, module.__dict__)


def register_packages(folders: dict[str, list[str]]) -> None:
    """Makes each named package importable (through JailFinder); parents become empty packages."""
    roots = {}
    for name, paths in folders.items():
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in sys.modules:
                module = types.ModuleType(prefix)
                module.__path__ = [NEUTRAL_ROOT + "/" + "/".join(parts[1:depth])]
                sys.modules[prefix] = module
                if depth > 1:
                    setattr(sys.modules[".".join(parts[:depth - 1])], parts[depth - 1], module)
        roots[name] = next((p for p in paths if os.path.isdir(p)), paths[0])
    sys.meta_path.insert(0, JailFinder(roots))


if __name__ == "__main__":
    register_packages(CONFIG["packages"])  # noqa: F821 (set by the bootstrap)
    from crucible.services.sandbox_executor.jail import worker

    worker.main(CONFIG)  # noqa: F821
