"""What a tested job's report may hold, in one place: the sandbox's harness writes it, the supervisor reads
it, and the verifier's python_tests kind refuses a task it could not report whole.

Stdlib only: the sandbox worker imports it.
"""
from __future__ import annotations

# Tests a job reports, declared and run: a task declaring more is refused at submission (cut at 1,000,
# a perfect answer to 1,500 tests was paid 1,000 of them).
MAX_TESTS = 1000
