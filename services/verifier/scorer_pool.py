"""Scoring processes with a hard time limit per completion.

Every completion is scored in one of `workers` child processes
(`scorer_worker.py`). One that takes longer than the limit, or kills its
process (a parser recursing into a segfault, sympy on a 10-million-digit
power), is given a `failed` verdict (reward 0, `scoring_failed`) and its
process is replaced; the service itself never runs model output through a
parser, so it never hangs on one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
from pathlib import Path

from crucible.v1 import verdict_pb2
from crucible.services.verifier import handler
from crucible.services.verifier.scorer_worker import ERROR, OK, UNVERIFIABLE
from crucible.shared.settings import Settings, get_settings

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


class ScoringError(RuntimeError):
    """The scorer raised (a bug, not the completion's fault): retry, then dead-letter."""


class _Process:
    def __init__(self, index: int):
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protos"), env.get("PYTHONPATH", "")])
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "crucible.services.verifier.scorer_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
            limit=64 << 20)
        status, payload = await self._read()
        if status != OK or payload != b"ready":
            raise RuntimeError(f"scoring process {self.index} did not start: {payload[:300]!r}")

    async def _read(self) -> tuple[int, bytes]:
        (n,) = struct.unpack(">I", await self.proc.stdout.readexactly(4))
        data = await self.proc.stdout.readexactly(n)
        return data[0], data[1:]

    async def ask(self, data: bytes) -> tuple[int, bytes]:
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        await self.proc.stdin.drain()
        return await self._read()

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


class ScorerPool:
    def __init__(self, settings: Settings | None = None, workers: int | None = None,
                 timeout_s: float | None = None):
        self.settings = settings or get_settings()
        self.size = workers or self.settings.verifier_workers or os.cpu_count() or 1
        self.timeout_s = timeout_s or self.settings.verifier_score_timeout_s
        self._idle: asyncio.Queue[_Process] = asyncio.Queue()
        self._all: list[_Process] = []
        self.failures = 0

    async def start(self) -> "ScorerPool":
        self._all = [_Process(i) for i in range(self.size)]
        await asyncio.gather(*(p.start() for p in self._all))
        for p in self._all:
            self._idle.put_nowait(p)
        return self

    async def close(self) -> None:
        await asyncio.gather(*(p.stop() for p in self._all), return_exceptions=True)

    async def __aenter__(self) -> "ScorerPool":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def verify(self, request: verdict_pb2.VerifyRequest) -> verdict_pb2.Verdict:
        """The verdict; Unverifiable for a request that cannot be scored, ScoringError for a scorer bug."""
        data = request.SerializeToString()
        process = await self._idle.get()
        try:
            status, payload = await asyncio.wait_for(process.ask(data), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError) as exc:
            self.failures += 1
            why = (f"scoring took longer than {self.timeout_s:g}s" if isinstance(exc, asyncio.TimeoutError)
                   else "the scoring process died on this completion")
            log.warning("rollout %s: %s; replacing scoring process %d", request.rollout.id, why, process.index)
            await process.stop()
            await process.start()
            return handler.failed(request, why)
        except BaseException:
            await process.stop()  # cancelled mid-request: its reply would answer the next caller
            await process.start()
            raise
        finally:
            self._idle.put_nowait(process)
        if status == OK:
            return verdict_pb2.Verdict.FromString(payload)
        if status == UNVERIFIABLE:
            raise handler.Unverifiable(payload.decode("utf-8", "replace"))
        raise ScoringError(payload.decode("utf-8", "replace"))
