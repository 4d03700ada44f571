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


__all__ = ["Completion", "PolicyBackend", "create_backend"]
