"""python -m crucible.services.verifier.scorer_worker: one scoring process of the verifier's ScorerPool.

Reads length-prefixed VerifyRequest bytes on stdin, writes one reply frame per
request on stdout: a status byte (0 verdict, 1 unverifiable, 2 error) and the
Verdict bytes or the reason. Model output is parsed here (math-verify's
sympy, regular expressions, reasoning-gym scorers, Python's own parser on
candidate code), never in the service process, so input that hangs or crashes
a parser costs one of these processes, not the service.
"""
from __future__ import annotations

import os
import struct
import sys
import traceback

OK, UNVERIFIABLE, ERROR = 0, 1, 2


def _read_exact(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def _write(stream, status: int, payload: bytes) -> None:
    stream.write(struct.pack(">IB", len(payload) + 1, status) + payload)
    stream.flush()


def main() -> None:
    from crucible.v1 import verdict_pb2
    from crucible.services.verifier.handler import Unverifiable, verify

    # Import what scoring needs before saying ready, so a request never pays for it.
    import math_verify  # noqa: F401
    import reasoning_gym  # noqa: F401

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a library's print must never corrupt the reply stream
    _write(stdout, OK, b"ready")
    while True:
        header = _read_exact(stdin, 4)
        if header is None:
            return
        (n,) = struct.unpack(">I", header)
        data = _read_exact(stdin, n)
        if data is None:
            return
        try:
            request = verdict_pb2.VerifyRequest.FromString(data)
            _write(stdout, OK, verify(request).SerializeToString(deterministic=True))
        except Unverifiable as exc:
            _write(stdout, UNVERIFIABLE, str(exc).encode("utf-8", "replace"))
        except Exception as exc:  # a scorer bug: the service retries, then dead-letters the record
            where = traceback.extract_tb(exc.__traceback__)[-1]
            _write(stdout, ERROR, f"{type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:"
                                  f"{where.lineno})".encode("utf-8", "replace"))


if __name__ == "__main__":
    main()
