"""Language runners: how a job's code and tests become files in the jail.

The jail runs Python inside its pre-loaded interpreter. A new language adds a
runner here (and, in the jail, the way to start it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from crucible.services.sandbox_executor.candidate import MODULE_NAME

if TYPE_CHECKING:
    from crucible.services.sandbox_executor.pool import Job


def _python(job: "Job") -> tuple[dict[str, str], str, str | None]:
    if "\x00" in job.code or "\x00" in job.tests or "\x00" in job.prelude:
        from crucible.services.sandbox_executor.pool import JobRejected

        raise JobRejected("code or tests contain a NUL byte")
    if job.tests and not job.entry_point and "def test_" not in job.tests:
        from crucible.services.sandbox_executor.pool import JobRejected

        raise JobRejected("tests given without an entry_point: HumanEval-style check(candidate) needs one")
    # A tested job's program is the module the candidate's process loads it as (candidate.MODULE_NAME), so
    # a process it starts afresh (multiprocessing's spawn) imports its functions by that name.
    main = f"{MODULE_NAME}.py" if job.tests else "main.py"
    return {main: job.code}, main, (job.tests or None)


RUNNERS = {"python": _python}


def prepare(job: "Job") -> tuple[dict[str, str], str, str | None]:
    """(files to write in /work, the main file, test code or None) for the job's language."""
    runner = RUNNERS.get(job.language or "python")
    if runner is None:
        from crucible.services.sandbox_executor.pool import JobRejected

        raise JobRejected(f"language {job.language!r} is not supported; supported: {', '.join(sorted(RUNNERS))}")
    return runner(job)
