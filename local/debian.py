"""Tools the tests use that come from Debian packages (Prometheus, headless Chromium): found on PATH,
or installed with apt-get when this is a Debian machine run as root; elsewhere the error says how."""
from __future__ import annotations

import os
import shutil
import subprocess


class MissingTool(RuntimeError):
    """A tool is not installed and cannot be installed here; the text says what to do."""


def ensure(package: str, command: str, why: str, echo=print) -> str:
    """The path of `command`, installing Debian's `package` first when it is missing."""
    found = shutil.which(command)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise MissingTool(f"{command} is not installed: `apt-get install {package}` (Debian) or put {command} on PATH")
    echo(f"      installing Debian's {package} package ({why}) ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    done = subprocess.run(install, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:  # a stale package list: refresh it once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, stdin=subprocess.DEVNULL)
        done = subprocess.run(install, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not shutil.which(command):
        raise MissingTool(f"apt-get install {package} failed: {done.stderr[-500:]}")
    return shutil.which(command)
