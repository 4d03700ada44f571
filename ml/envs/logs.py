"""`logs`: find the cause of an incident in a folder of service logs.

Each task plants one incident: a component fails for one cause (its log has the telling errors),
and the services that depend on it log symptoms a little later. The model lists the files, greps
(a fixed string, case-insensitive: no pattern can make the environment hang) and reads lines, then
answers naming the failing component and the cause, e.g. "payments: disk full". Naming more than
one component or more than one cause is wrong. The folder is built from the task's seed for each
call and dropped afterwards; nothing the model sends is run as code.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterator

from crucible.ml import envs
from crucible.ml.envs.base import Call, Environment, InstanceError, Observation, Tool, split_of

COMPONENTS = ["api", "auth", "payments", "inventory", "search", "mailer"]
# cause -> (words that name it in an answer, the error lines the failing component logs)
CAUSES = {
    "disk full": (("disk full", "no space", "disk space", "out of disk"),
                  ["ERROR write failed: [Errno 28] No space left on device: '/var/lib/{c}/journal'",
                   "ERROR could not flush segment: No space left on device"]),
    "out of memory": (("out of memory", "oom", "oomkilled", "memory", "memoryerror"),
                      ["ERROR worker 3 killed: OOMKilled (memory limit 512Mi)",
                       "ERROR MemoryError while allocating response buffer"]),
    "connection pool exhausted": (("connection pool", "pool exhausted", "too many connections"),
                                  ["ERROR timeout acquiring connection: pool exhausted (size=20, waiting=57)",
                                   "WARN connection pool at capacity (20/20)"]),
    "certificate expired": (("certificate", "cert", "x509", "tls"),
                            ["ERROR TLS handshake failed: x509: certificate has expired",
                             "ERROR upstream TLS error: certificate expired on 2026-11-01"]),
    "deadlock": (("deadlock",), ["ERROR transaction aborted: deadlock detected",
                                 "ERROR deadlock detected while updating table orders"]),
}
NOISE = ["INFO request served in {ms}ms", "INFO health check ok", "DEBUG cache hit ratio 0.{ms}",
         "INFO processed batch of {n} items", "WARN slow request: {ms}ms", "INFO config reloaded"]
READ_LINES = 20
GREP_LINES = 25


def folder(data: dict) -> dict[str, list[str]]:
    """The log files of an instance: file name -> lines. The same instance always gives the same files."""
    rng = random.Random(data["seed"])
    failing, cause = data["component"], data["cause"]
    files = {}
    incident_at = rng.randrange(25, 45)
    for component in data["components"]:
        lines = []
        for i in range(rng.randrange(55, 75)):
            stamp = f"2026-11-30T10:{i // 2:02d}:{(i * 29) % 60:02d}Z"
            if component == failing and i >= incident_at and (i - incident_at) % 4 == 0:
                text = rng.choice(CAUSES[cause][1]).format(c=component)
            elif component != failing and i >= incident_at + 3 and rng.random() < 0.3:
                text = f"ERROR call to {failing} failed: upstream returned 503"
            else:
                text = rng.choice(NOISE).format(ms=rng.randrange(3, 900), n=rng.randrange(1, 200))
            lines.append(f"{stamp} {component} {text}")
        files[f"{component}.log"] = lines
    return files


class Logs(Environment):
    name = "logs"
    description = "Find the failing component and the cause of an incident in service logs."
    tools = (Tool("list", "Lists the log files with their line counts.", {}),
             Tool("grep", "Lines containing a text (case-insensitive), as file:line: text.", {"text": "what to find"}),
             Tool("read", f"{READ_LINES} lines of a file from a line number.", {"file": "the file name",
                                                                               "line": "the first line (from 1)"}))
    max_turns = 8

    def check_instance(self, data: dict) -> None:
        components = data.get("components")
        if (not isinstance(components, list) or not components or not all(c in COMPONENTS for c in components)
                or len(set(components)) != len(components)):
            raise InstanceError(f"logs needs 'components': a list from {', '.join(COMPONENTS)}, each once")
        if data.get("component") not in components:
            raise InstanceError("logs needs 'component': the failing one, among 'components'")
        if data.get("cause") not in CAUSES:
            raise InstanceError(f"logs needs 'cause': one of {', '.join(CAUSES)}")
        if not isinstance(data.get("seed"), int):
            raise InstanceError("logs needs 'seed': an integer")

    def observe(self, task, earlier, call, result=None) -> Observation:
        files = folder(self.instance(task))
        if call.name == "list":
            return Observation("\n".join(f"{name} ({len(lines)} lines)" for name, lines in sorted(files.items())))
        if call.name == "grep":
            needle = call.arguments["text"].strip().lower()
            if not needle:
                return Observation("error: grep needs a text to find", failed=True)
            hits = [f"{name}:{i}: {line}" for name, lines in sorted(files.items())
                    for i, line in enumerate(lines, 1) if needle in line.lower()]
            more = f"\n[{len(hits) - GREP_LINES} more matching lines]" if len(hits) > GREP_LINES else ""
            return Observation("\n".join(hits[:GREP_LINES]) + more if hits else "no line contains that text")
        name = call.arguments["file"].strip()
        if name not in files:
            return Observation(f"error: no file {name[:60]!r}; the files are {', '.join(sorted(files))}", failed=True)
        try:
            start = max(1, int(call.arguments["line"].strip() or 1))
        except ValueError:
            return Observation("error: line must be a number", failed=True)
        lines = files[name][start - 1: start - 1 + READ_LINES]
        if not lines:
            return Observation(f"{name} has {len(files[name])} lines", failed=True)
        return Observation("\n".join(f"{start + i}: {line}" for i, line in enumerate(lines)))

    def check_answer(self, task, answer: str, calls: list[Call]) -> dict[str, float]:
        data = self.instance(task)
        text = answer.lower()
        # Whole words only: "searched" names no `search`, "rapid" no `api`, "concert" no certificate.
        named = {c for c in data["components"] if _says(text, c)}
        causes = {cause for cause, (words, _) in CAUSES.items() if any(_says(text, w, forms=True) for w in words)}
        component_right = named == {data["component"]}
        cause_right = causes == {data["cause"]}
        return {"answer_correct": float(component_right and cause_right), "component_correct": float(component_right),
                "cause_correct": float(cause_right)}

    def generate(self, split: str, *, seed: int, group_size: int = 8) -> Iterator:
        rng = random.Random(seed)
        while True:
            components = sorted(rng.sample(COMPONENTS, rng.randrange(3, 6)))
            data = {"components": components, "component": rng.choice(components),
                    "cause": rng.choice(sorted(CAUSES)), "seed": rng.randrange(1 << 30)}
            identity = f"{data['seed']}"
            if split_of(identity) != split:
                continue
            prompt = ("An incident hit the services whose logs are in this folder. Which component failed first, "
                      "and why? Answer as component: cause.")
            yield self.task(prompt, data, split=split, key=identity, group_size=group_size)

    def reference(self, task) -> list[str]:
        data = self.instance(task)
        return ["@list", "@grep error", f"{data['component']}: {data['cause']}"]


envs.register(Logs())


def _says(text: str, words: str, forms: bool = False) -> bool:
    """Whether `text` (lowered) holds `words` as whole words, `_` a word's edge ("auth_service" names auth);
    `forms`: a plural or past form too ("certificates", "deadlocked"; a component's name takes none:
    "searched" names no search)."""
    suffix = "(?:s|es|d|ed)?" if forms else ""
    return re.search(rf"(?<![a-z0-9]){re.escape(words.lower())}{suffix}(?![a-z0-9])", text) is not None
