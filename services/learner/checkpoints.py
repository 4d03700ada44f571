"""The learner's checkpoints: weights, step, version and consumer offsets, all or nothing; the
optimiser state every `learner_optimizer_every` versions.

Each version is its own folder `v000123` under runs/<run_id>/checkpoints (written to a temporary
name and renamed into place); the highest complete one is where a restarted learner resumes,
seeking its consumer to the offsets stored with those weights. The optimiser state (twice the
weights) is written with versions that are multiples of `learner_optimizer_every`: a learner resumed
between two takes the newest one written (`optimizer_source`), so weights, versions and the samples
trained on stay exact and only Adam's moments are a few steps older. Pruning keeps that folder.
"""
from __future__ import annotations

import logging
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from crucible.ml.policy import transfer
from crucible.ml.policy.checkpoint import load_checkpoint, path_from_uri, save_checkpoint
from crucible.shared.settings import Settings

OPTIMIZER_FILE = "optimizer.pt"   # the whole optimiser state (one process, or DDP: every rank holds it)
OPTIMIZER_SHARDS = "optimizer"     # FSDP: one file per rank (torch.distributed.checkpoint), reshardable
_VERSION_DIR = re.compile(rf"^{transfer.VERSION_FOLDER.pattern}$")
log = logging.getLogger("crucible.learner")


def run_dir(settings: Settings) -> Path:
    return settings.home / "runs" / settings.run_id


def checkpoints_dir(settings: Settings) -> Path:
    return run_dir(settings) / "checkpoints"


def version_dir(settings: Settings, version: int) -> Path:
    return checkpoints_dir(settings) / f"v{version:06d}"


def latest(settings: Settings) -> Path | None:
    found = _versions(checkpoints_dir(settings))
    return found[-1][1] if found else None


def newest_first(settings: Settings) -> list[Path]:
    """The run's complete versions, newest first."""
    return [p for _, p in reversed(_versions(checkpoints_dir(settings)))]


@dataclass(frozen=True)
class Captured:
    """A version's weights and (when due) optimiser state, copied off the live model: written by `save`
    while the next step changes the model (capture)."""

    version: int
    step: int
    weights: dict
    optimizer_state: dict | None


def _with_optimizer(trainer, version: int) -> bool:
    return version % trainer.config.learner_optimizer_every == 0  # the same on every rank


def capture(trainer) -> Captured | None:
    """The state the current version's checkpoint holds, copied into host memory, so that the next step
    may train while it is written: the write (12-17 ms a version for the built-in recipe here, seconds for
    a pretrained model) leaves the step's path, where only this copy stays. None where the state cannot be
    copied so and `save` must read it itself, before the next step: several ranks or FSDP (gathering and
    writing are collective), or a LoRA model (its adapters are merged into a copy of the model as it is
    written)."""
    if trainer.ranks.distributed or hasattr(trainer.model, "merge_and_unload"):
        return None
    _, optimizer_state = trainer.checkpoint_state(optimizer=_with_optimizer(trainer, trainer.version))
    return Captured(trainer.version, trainer.step_count, _host_copy(trainer.model.state_dict(), {}),
                    None if optimizer_state is None else _host_copy(optimizer_state, {}))


def _host_copy(value, copied: dict):
    """`value` (tensors, in dicts, lists and tuples) with every tensor copied into host memory; tensors that
    are views of one storage alike (tied weights) stay one tensor, as the model's own state dict has them."""
    if isinstance(value, torch.Tensor):
        key = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
        if key not in copied:
            copied[key] = value.detach().to("cpu", copy=True)
        return copied[key]
    if isinstance(value, dict):
        return type(value)((k, _host_copy(v, copied)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v, copied) for v in value)
    return value


def save(settings: Settings, trainer, offsets: dict[int, int], trained_ids: list[str], reference_uri: str,
         step_records: list[dict] | None = None, recent_ids: dict | None = None,
         captured: Captured | None = None) -> Path | None:
    """`step_records` (rows.step_entry: the steps whose rows are not in the store yet) lets a learner
    restarted before they were written write them; `recent_ids` are the ids the last steps trained on.
    `captured`: the version's state as `capture` copied it (the model may have changed since); without it,
    the model's state as it is now.

    Every rank calls it, in the same order (gathering sharded weights and writing optimiser shards are
    collective); rank 0 writes the folder and renames it into place, the others get None."""
    version = trainer.version if captured is None else captured.version
    step = trainer.step_count if captured is None else captured.step
    with_optimizer = _with_optimizer(trainer, version)
    shards = None
    if captured is not None:
        weights, optimizer_state = captured.weights, captured.optimizer_state
    else:
        if with_optimizer and trainer.ranks.sharding == "fsdp":  # each rank writes its shard; rank 0 moves them in
            shards = checkpoints_dir(settings) / f".v{version:06d}.{OPTIMIZER_SHARDS}"
            if not trainer.save_optimizer_shards(shards):
                shards = None
        weights, optimizer_state = trainer.checkpoint_state(optimizer=with_optimizer)
    if not trainer.ranks.main:
        return None
    meta = {"run_id": settings.run_id, "version": version, "step": step,
            "offsets": {str(p): o for p, o in offsets.items()}, "trained_ids_past_offsets": trained_ids,
            "reference_uri": reference_uri, "step_records": step_records or [], "recent_trained_ids": recent_ids or []}
    folder = save_checkpoint(trainer.model, version_dir(settings, version), meta,
                             extra={OPTIMIZER_FILE: optimizer_state} if optimizer_state is not None else {},
                             tokenizer_from=path_from_uri(reference_uri), weights=weights,
                             folders={OPTIMIZER_SHARDS: shards} if shards else {})
    prune(settings)
    return folder


def load(folder: Path):
    """(model, meta, optimiser state): the weights of `folder` and the optimiser state of
    `optimizer_source(folder)`: the whole state dict, or for shards the folder they are in (Trainer
    loads either, on any number of ranks), or None."""
    model, meta = load_checkpoint(folder)
    source = optimizer_source(folder)
    if source is None:
        log.warning("resuming at %s without optimiser state: none was written at or before it", folder.name)
        return model, meta, None
    if source != folder:
        log.info("resuming at %s with the optimiser state written at %s", folder.name, source.name)
    if (source / OPTIMIZER_SHARDS).is_dir():
        return model, meta, source / OPTIMIZER_SHARDS
    try:
        return model, meta, torch.load(source / OPTIMIZER_FILE, weights_only=True)  # tensors and numbers only: never code
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        # Adam's moments, damaged: the weights and everything else of the version are sound, and are resumed
        log.error("resuming at %s without optimiser state: %s's does not load: %s: %s", folder.name, source.name,
                  type(exc).__name__, str(exc)[:300])
        return model, meta, None


def has_optimizer(folder: Path) -> bool:
    return (folder / OPTIMIZER_FILE).exists() or (folder / OPTIMIZER_SHARDS).is_dir()


def _versions(folder: Path, complete: bool = True) -> list[tuple[int, Path]]:
    """The (complete) version folders under `folder`, oldest first (by number)."""
    if not folder.exists():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _VERSION_DIR.match(p.name))
                  and (not complete or (p / "crucible.json").exists()))


# files.staging's, replace_folder's (named after the version folder), FSDP's shards
_UNFINISHED = re.compile(rf"^\.{transfer.VERSION_FOLDER.pattern}\.(tmp-|old-|optimizer$)")


def clear_unfinished(settings: Settings) -> list[str]:
    """Removes what writes of versions left behind when they failed (a full disk) or their learner died:
    folders a version's weights large each, which nothing else ever removes. Only at a learner's start,
    when no write is under way. Returns their names. A version's folder set aside to be replaced
    (`.v000123.old-*`) whose replacement never took its place is put back instead."""
    folder = checkpoints_dir(settings)
    left = sorted(p for p in folder.iterdir() if _UNFINISHED.match(p.name)) if folder.is_dir() else []
    for p in left:
        own = folder / p.name[1:].split(".", 1)[0]
        if ".old-" in p.name and not own.exists() and (p / "crucible.json").exists():
            p.rename(own)
            continue
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in left]


def newest_number(settings: Settings) -> int:
    """The highest version any folder of the run's checkpoints is numbered with, whole or not (-1: none):
    a version a learner may have announced."""
    folder = checkpoints_dir(settings)
    names = (re.match(rf"^\.?{transfer.VERSION_FOLDER.pattern}(\.|$)", p.name) for p in folder.iterdir()) \
        if folder.is_dir() else ()
    return max((int(m.group(1)) for m in names if m), default=-1)


def optimizer_source(folder: Path) -> Path | None:
    """The folder whose optimiser state a learner resuming at `folder` takes: its own, else the newest
    earlier version's that has one."""
    if has_optimizer(folder):
        return folder
    m = _VERSION_DIR.match(folder.name)
    older = [p for v, p in _versions(folder.parent) if m and v < int(m.group(1))]
    return next((p for p in reversed(older) if has_optimizer(p)), None)


def prune(settings: Settings) -> None:
    """Keeps the newest `learner_keep_checkpoints` versions (generators may still be loading recent ones)
    and the newest one holding optimiser state (where a resumed learner takes it from). Newest by number:
    by name, v1000000 sorted before v999999, and the version just written was the one removed."""
    folder = checkpoints_dir(settings)
    versions = [p for _, p in _versions(folder, complete=False)]
    keep = set(versions[-settings.learner_keep_checkpoints:])
    keep.update(next(([p] for _, p in reversed(_versions(folder)) if has_optimizer(p)), []))
    for old in versions:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
