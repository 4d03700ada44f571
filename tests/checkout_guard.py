"""The test session leaves the checkout exactly as it found it: nothing created, nothing changed.

Everything a test or a service writes belongs under CRUCIBLE_HOME or a temporary folder. The
checkout's state (untracked and ignored files included) is taken when the session starts and
compared when it ends; any difference fails the session and is listed.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_before: set[str] | None = None


def checkout_state() -> set[str] | None:
    """`git status` lines for everything not committed (ignored files too), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.splitlines())


def pytest_sessionstart(session):
    global _before
    _before = checkout_state()


def pytest_sessionfinish(session, exitstatus):
    after = checkout_state()
    if _before is None or after is None:
        return
    created = sorted(after - _before)
    if created:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"the test session changed the checkout {ROOT} (write under CRUCIBLE_HOME or a temporary folder):",
                 *(f"  {line}" for line in created[:50])]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True, bold=True)
        session.exitstatus = 1
