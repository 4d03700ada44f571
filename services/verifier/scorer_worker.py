"""python -m crucible.services.verifier.scorer_worker: one scoring process of the verifier's ScorerPool.

Reads frames on stdin, each holding one or more VerifyRequests (framing.join: a
group's completions travel together, one round trip for all of them), and
writes one frame per request frame on stdout holding a reply per request, in
order: a status byte (0 verdict, 1 unverifiable, 2 error), then the Verdict
bytes or the reason. Model output is
parsed here (math-verify's sympy, regular expressions, reasoning-gym scorers,
Python's own parser on candidate code), never in the service process, so input
that hangs or crashes a parser costs one of these processes, not the service.
"""
from __future__ import annotations

import logging
import os
import traceback

from crucible.shared import framing

OK, UNVERIFIABLE, ERROR = 0, 1, 2


def encode_reply(status: int, payload: bytes) -> bytes:
    return bytes([status]) + payload


def decode_reply(frame: bytes) -> tuple[int, bytes]:
    return frame[0], frame[1:]


def main() -> None:
    from crucible.v1 import verdict_pb2
    from crucible.services.verifier.handler import Unverifiable, verify

    # Import what scoring needs before saying ready, so a request never pays for it.
    import math_verify  # noqa: F401
    import reasoning_gym  # noqa: F401

    # math_verify logs a parse that ran out of time with the whole answer in it: a completion's text, as
    # long and with whatever control characters its author chose, in the service's log.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    # Replies go to a private copy of stdout; descriptor 1 becomes stderr, so nothing a library
    # prints (from Python or from C) can corrupt the reply stream.
    replies = os.dup(1)
    os.dup2(2, 1)
    framing.write(replies, encode_reply(OK, b"ready"))

    def score(data: bytes) -> bytes:
        try:
            request = verdict_pb2.VerifyRequest.FromString(data)
            return encode_reply(OK, verify(request).SerializeToString(deterministic=True))
        except Unverifiable as exc:
            return encode_reply(UNVERIFIABLE, str(exc).encode("utf-8", "replace"))
        except Exception as exc:  # a scorer bug: the service retries, then dead-letters the record
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return encode_reply(ERROR, f"{type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:"
                                       f"{where.lineno})".encode("utf-8", "replace"))

    while (data := framing.read(0)) is not None:
        try:
            batch = framing.split(data)
        except (framing.TruncatedFrame, framing.FrameTooLarge) as exc:  # the service's bug, not a completion's
            framing.write(replies, framing.join([encode_reply(ERROR, f"malformed request frame: {exc}".encode())]))
            continue
        framing.write(replies, framing.join([score(item) for item in batch]))


if __name__ == "__main__":
    main()
