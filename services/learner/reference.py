"""Reference log-probs worked out ahead of the step that needs them.

A step's KL term reads each sample's log-probs under the reference policy: one forward pass of the
reference model over the batch, about a fifth of a step of the built-in recipe. The reference never
changes, so the pass need not wait for the step: as groups arrive (the aggregator sends them one by
one while the learner trains the step before), a thread of this learner's own reads them through the
reference, in one batch whatever has arrived since it last looked, and the step takes what is ready
(Trainer.step's `reference`). A group still being read is waited for (most of its pass is done);
one whose pass failed is read again inside the step, where a real fault is raised.

Off when the learner has several ranks (each rank reads its own share of a step, and the reference
of a sharded model is read by all of them at once) and for DPO (its pairs read the reference
themselves).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from crucible.v1 import trajectory_pb2

log = logging.getLogger(__name__)


class ReferenceAhead:
    def __init__(self, trainer):
        self.trainer = trainer
        self.enabled = trainer.ranks.world == 1 and trainer.config.objective != "dpo"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reference") if self.enabled else None
        self._lock = threading.Lock()
        self._queued: list[tuple[list[trajectory_pb2.Trajectory], Future]] = []  # not read yet
        self._groups: dict[str, Future] = {}  # group id -> its samples' reference log-probs, by sample id

    def submit(self, group_id: str, samples: list[trajectory_pb2.Trajectory]) -> None:
        """Reads a whole group through the reference, soon (once: a group given again is ignored)."""
        if not self.enabled or group_id in self._groups:
            return
        done: Future = Future()
        self._groups[group_id] = done
        with self._lock:
            self._queued.append((samples, done))
        self._pool.submit(self._read)

    def _read(self) -> None:
        """Everything queued since the last read, in one pass (one call per group would pay the model's
        per-call cost that many times)."""
        with self._lock:
            queued, self._queued = self._queued, []
        if not queued:
            return  # an earlier call read these along with its own
        try:
            found = self.trainer.reference_logprobs([s for samples, _ in queued for s in samples])
        except Exception as exc:  # the step reads them again and raises what is wrong, where it belongs
            for _, done in queued:
                done.set_exception(exc)
            return
        for samples, done in queued:
            done.set_result({s.id: found[s.id] for s in samples})

    def take(self, group_ids: list[str]) -> dict[str, torch.Tensor]:
        """The reference log-probs of these groups' samples (waiting for any still being read), and
        forgets them; groups never given, or whose pass failed, are left out."""
        out: dict[str, torch.Tensor] = {}
        for group_id in group_ids:
            done = self._groups.pop(group_id, None)
            if done is None:
                continue
            try:
                out.update(done.result())
            except Exception as exc:
                log.warning("reference log-probs of group %r were not read ahead (%r): the step reads them",
                            group_id, exc)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
