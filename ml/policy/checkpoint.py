"""Checkpoints in Hugging Face's layout (config.json, model.safetensors, tokenizer files), written atomically.

The same folder loads in transformers (`AutoModelForCausalLM.from_pretrained`) and vLLM.
`crucible.json` beside them records what Crucible needs to resume (version, step, ...).
A checkpoint is the built-in policy (config.json says so) or any transformers causal LM
(ml/policy/hf.py); `load_checkpoint` and `save_checkpoint` take either.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors.torch import load_file, save_file

from crucible.ml.policy import hf
from crucible.shared import files
from crucible.ml.policy.model import Policy, PolicyConfig
from crucible.ml.policy.tokenizer import ByteTokenizer

META_FILE = "crucible.json"


def path_from_uri(uri: str) -> Path:
    """A local folder from `file:///abs/path` or a plain path; other schemes are refused clearly."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    raise ValueError(f"checkpoint URI {uri!r}: only local paths and file:// URIs are supported")


def save_checkpoint(model, folder: Path, meta: dict | None = None, extra: dict | None = None,
                    tokenizer_from: Path | None = None, weights: dict | None = None,
                    folders: dict[str, Path] | None = None) -> Path:
    """Writes the checkpoint into a temporary sibling, then renames it into place (never half-written).

    `extra` maps file names to objects saved alongside (e.g. optimizer state) with torch.save.
    A transformers model's tokenizer files are copied from `tokenizer_from` (its initial folder).
    `weights`: the model's whole state dict, where `model` holds only a shard of it (FSDP).
    `folders` maps names to finished folders moved into the checkpoint (e.g. optimiser shards).
    """
    folder = Path(folder)
    tmp = files.staging(folder)
    try:
        if isinstance(model, Policy):
            _write_builtin(model, tmp, weights)
        else:
            hf.write(model, tmp, tokenizer_from, weights)
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / name)
        for name, source in (folders or {}).items():
            Path(source).rename(tmp / name)
        # Compact: a learner's meta lists the ids its last steps trained on (about 300 KB a version for the
        # built-in recipe), written on every step's path; indented, it took 1.9 ms to encode, now 0.6.
        (tmp / META_FILE).write_text(json.dumps(meta or {}, separators=(",", ":")))
        return files.replace_folder(tmp, folder)
    except BaseException:  # a full disk, say: a folder the weights' size, which nothing else would remove
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_builtin(model: Policy, tmp: Path, weights: dict | None = None) -> None:
    state = {k: v.detach().contiguous() for k, v in (model.state_dict() if weights is None else weights).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    hf_config = model.config.to_hf()
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps(
        {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, indent=1))
    ByteTokenizer().save(tmp)


def load_checkpoint(folder: Path | str, device: str = "cpu"):
    """(the model, crucible.json's contents): the built-in Policy, or a transformers model."""
    folder = path_from_uri(str(folder)) if isinstance(folder, str) else Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not a checkpoint: config.json is missing")
    meta = json.loads((folder / META_FILE).read_text()) if (folder / META_FILE).exists() else {}
    if not hf.is_builtin(folder):
        return hf.load_model(folder, device), meta
    model = Policy(_builtin_config(folder))
    _load_weights(model, folder)
    return model, meta


def weights_for(model, folder: Path | str) -> dict | None:
    """The weights of the built-in checkpoint in `folder`, read and checked to fit `model` tensor for
    tensor, when `model` is a built-in policy of the very same config (a later version of the same
    run): `model.load_state_dict(weights, strict=False)` then copies them in place, and no second
    model is built and initialised only to be overwritten. None when they cannot be copied so."""
    folder = path_from_uri(str(folder)) if isinstance(folder, str) else Path(folder)
    if not isinstance(model, Policy) or not hf.is_builtin(folder) or _builtin_config(folder) != model.config:
        return None
    state = load_file(str(folder / "model.safetensors"))
    expected = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()
                if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    return state if {k: (v.shape, v.dtype) for k, v in state.items()} == expected else None


def _builtin_config(folder: Path) -> PolicyConfig:
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not a checkpoint: config.json is missing")
    return PolicyConfig.from_hf(json.loads((folder / "config.json").read_text()))


def _load_weights(model: Policy, folder: Path) -> None:
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (model.config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match its config: missing {missing}, unexpected {unexpected}")


def fresh_policy(seed: int, config: PolicyConfig | None = None) -> Policy:
    return Policy(config or PolicyConfig()).init_weights(seed)
