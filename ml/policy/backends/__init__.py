"""Policy backends behind one interface, picked by name (CRUCIBLE_GENERATOR_BACKEND)."""
from __future__ import annotations

from crucible.ml.policy.backends.base import Completion, PolicyBackend


def create_backend(name: str, **options) -> PolicyBackend:
    """`torch` (the default, CPU), `hf` (transformers from a local folder) or `vllm` (GPU)."""
    if name == "torch":
        from crucible.ml.policy.backends.torch_backend import TorchBackend

        return TorchBackend(**options)
    if name == "hf":
        from crucible.ml.policy.backends.hf_backend import HFBackend

        return HFBackend(**options)
    if name == "vllm":
        from crucible.ml.policy.backends.vllm_backend import VLLMBackend

        return VLLMBackend(**options)
    raise ValueError(f"unknown policy backend {name!r}: choose torch, hf or vllm")


def backend_for(settings, checkpoint: str | None, name: str | None = None, **options) -> PolicyBackend:
    """The backend a run samples `checkpoint` with: `settings.generator_backend`, where `auto` means the
    built-in policy in torch and any other checkpoint in transformers; the run's prompt settings."""
    from crucible.ml.policy.checkpoint import path_from_uri
    from crucible.ml.policy.hf import is_builtin

    name = name or settings.generator_backend
    if name == "auto":
        name = "torch" if not checkpoint or is_builtin(path_from_uri(checkpoint)) else "hf"
    if name == "torch":
        return create_backend(name, checkpoint=checkpoint, seed=settings.seed, **options)
    if not checkpoint:
        raise ValueError(f"the {name} backend needs a model: set init_checkpoint (CRUCIBLE_INIT_CHECKPOINT)")
    if name == "vllm":
        options.setdefault("tensor_parallel_size", getattr(settings, "vllm_tensor_parallel", 1))
    return create_backend(name, checkpoint=checkpoint, chat_template=settings.chat_template,
                          system_prompt=settings.system_prompt, **options)


__all__ = ["Completion", "PolicyBackend", "backend_for", "create_backend"]
