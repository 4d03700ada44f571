"""Prometheus on one machine: Debian's `prometheus` package, scraping the services' /metrics endpoints.

`ensure_installed()` installs the package when it is missing and this is a Debian machine run as
root (what `crucible test` needs for the scrape test; elsewhere it says how). `LocalPrometheus`
runs one server on 127.0.0.1 with a generated configuration and its data in a folder of yours.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from crucible.local import debian

PACKAGE = "prometheus"


class PrometheusError(debian.MissingTool):
    """Prometheus cannot be installed or started here; the text says why and what to do."""


def binary() -> str | None:
    return shutil.which("prometheus")


def ensure_installed(echo=print) -> str:
    """The prometheus binary, installing Debian's package first when it is missing (as root)."""
    return debian.ensure(PACKAGE, "prometheus", "for the metrics scrape test", echo)


class LocalPrometheus:
    """One Prometheus server scraping `targets` ({job: "host:port"}) every `interval_s`."""

    def __init__(self, root: Path, port: int, targets: dict[str, str], interval_s: float = 1.0):
        self.root, self.port, self.targets, self.interval_s = Path(root), port, targets, interval_s
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "LocalPrometheus":
        exe = binary()
        if exe is None:
            raise PrometheusError("prometheus is not installed (crucible.local.prometheus.ensure_installed)")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        jobs = "\n".join(f"  - job_name: {json.dumps(job)}\n    static_configs: [{{targets: [{json.dumps(t)}]}}]"
                         for job, t in sorted(self.targets.items()))
        every = f"{int(self.interval_s * 1000)}ms"
        config.write_text(f"global:\n  scrape_interval: {every}\n  evaluation_interval: {every}\n"
                          f"scrape_configs:\n{jobs}\n")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=open(self.root / "prometheus.log", "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError("prometheus exited: " + (self.root / "prometheus.log").read_text()[-800:])
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.2)
        raise PrometheusError(f"prometheus did not get ready in {timeout:g}s")

    def query(self, promql: str) -> list[dict]:
        """An instant query's result vector ([{"metric": {...}, "value": [t, "v"]}, ...])."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(urllib.request.urlopen(url, timeout=5).read())
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
