"""Installed, Crucible is one namespace: `crucible`. It claims no generic top-level name."""
from __future__ import annotations

import json
import subprocess
import sys


def test_the_installed_package_is_one_crucible_namespace(tmp_path):
    # Run from an empty folder, so only what is installed can be imported (not the checkout's folders).
    probe = """
import importlib.metadata, importlib.util, json
names = ["shared", "services", "ml", "local", "cli", "recipes", "crucible", "crucible.recipes", "crucible.shared.bus", "crucible.ml.policy.model",
         "crucible.services.learner.loop", "crucible.local.kafka", "crucible.cli.main", "crucible.v1.task_pb2"]
found = {n: importlib.util.find_spec(n) is not None for n in names}
scripts = [e.value for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "crucible"]
print(json.dumps({"found": found, "scripts": scripts}))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    result = json.loads(out.stdout)
    found = result["found"]
    assert not any(found[n] for n in ("shared", "services", "ml", "local", "cli", "recipes")), found
    assert all(found[n] for n in found if n.startswith("crucible")), found
    assert result["scripts"] == ["crucible.cli.main:main"]
