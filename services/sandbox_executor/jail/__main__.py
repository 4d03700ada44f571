"""Starts a sandbox worker: `python -I -S -B <this file> CONFIG_JSON` (see pool.py).

With `-I -S` the installed `crucible` package cannot be imported the usual way
(an install lives in site-packages, an editable one is found through it). The
pool passes, in `config["packages"]`, the folders of the two packages the worker
runs from, read from its own imports: crucible.shared (for framing) and
crucible.services.sandbox_executor. They are registered here as bare packages,
so `from crucible.shared import framing` loads the very file the service uses,
and no package's `__init__` runs (the worker imports nothing beyond the
standard library, and only the modules it names).
"""
import json
import sys
import types


def register_packages(folders: dict[str, list[str]]) -> None:
    """Makes each named package importable from its folders; parents become empty packages."""
    for name, path in folders.items():
        parts = name.split(".")
        parent = None
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            module = sys.modules.get(prefix)
            if module is None:
                module = types.ModuleType(prefix)
                module.__path__ = []  # finds only what is registered below it
                sys.modules[prefix] = module
                if parent is not None:
                    setattr(parent, parts[depth - 1], module)
            parent = module
        parent.__path__ = list(path)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    register_packages(config["packages"])
    from crucible.services.sandbox_executor.jail import worker

    worker.main(config)
