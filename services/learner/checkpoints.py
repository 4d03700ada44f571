"""The learner's checkpoints: weights, optimizer, step, version and consumer offsets, all or nothing.

Each version is its own folder `v000123` under runs/<run_id>/checkpoints (written to a temporary
name and renamed into place); the highest complete one is where a restarted learner resumes,
seeking its consumer to the offsets stored with those weights.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from crucible.ml.policy.checkpoint import load_checkpoint, path_from_uri, save_checkpoint
from crucible.shared.settings import Settings

OPTIMIZER_FILE = "optimizer.pt"   # the whole optimiser state (one process, or DDP: every rank holds it)
OPTIMIZER_SHARDS = "optimizer"     # FSDP: one file per rank (torch.distributed.checkpoint), reshardable
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def run_dir(settings: Settings) -> Path:
    return settings.home / "runs" / settings.run_id


def checkpoints_dir(settings: Settings) -> Path:
    return run_dir(settings) / "checkpoints"


def version_dir(settings: Settings, version: int) -> Path:
    return checkpoints_dir(settings) / f"v{version:06d}"


def latest(settings: Settings) -> Path | None:
    folder = checkpoints_dir(settings)
    if not folder.exists():
        return None
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _VERSION_DIR.match(p.name))
                   and (p / "crucible.json").exists())
    return found[-1][1] if found else None


def save(settings: Settings, trainer, offsets: dict[int, int], trained_ids: list[str], reference_uri: str,
         step_record: dict | None = None, recent_ids: list[list[str]] | None = None) -> Path | None:
    """`step_record` (the step's metrics, skips and sample ids) lets a learner restarted before the
    step's rows were written write them; `recent_ids` are the ids the last steps trained on.

    Every rank calls it, in the same order (gathering sharded weights and writing optimiser shards are
    collective); rank 0 writes the folder and renames it into place, the others get None."""
    shards = None
    if trainer.ranks.sharding == "fsdp":  # each rank writes its shard beside the folder; rank 0 moves them in
        shards = checkpoints_dir(settings) / f".v{trainer.version:06d}.{OPTIMIZER_SHARDS}"
        if not trainer.save_optimizer_shards(shards):
            shards = None
    weights, optimizer_state = trainer.checkpoint_state()
    if not trainer.ranks.main:
        return None
    meta = {"run_id": settings.run_id, "version": trainer.version, "step": trainer.step_count,
            "offsets": {str(p): o for p, o in offsets.items()}, "trained_ids_past_offsets": trained_ids,
            "reference_uri": reference_uri, "step_record": step_record, "recent_trained_ids": recent_ids or []}
    folder = save_checkpoint(trainer.model, version_dir(settings, trainer.version), meta,
                             extra={OPTIMIZER_FILE: optimizer_state} if optimizer_state is not None else {},
                             tokenizer_from=path_from_uri(reference_uri), weights=weights,
                             folders={OPTIMIZER_SHARDS: shards} if shards else {})
    prune(settings)
    return folder


def load(folder: Path):
    """(model, meta, optimiser state): the whole state dict, or for shards the folder they are in
    (Trainer loads either, on any number of ranks), or None."""
    model, meta = load_checkpoint(folder)
    if (folder / OPTIMIZER_SHARDS).is_dir():
        return model, meta, folder / OPTIMIZER_SHARDS
    optimizer_state = torch.load(folder / OPTIMIZER_FILE) if (folder / OPTIMIZER_FILE).exists() else None
    return model, meta, optimizer_state


def prune(settings: Settings) -> None:
    """Keeps the newest `learner_keep_checkpoints` versions (generators may still be loading recent ones)."""
    folder = checkpoints_dir(settings)
    versions = sorted(p for p in folder.iterdir() if _VERSION_DIR.match(p.name))
    for old in versions[: -settings.learner_keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
