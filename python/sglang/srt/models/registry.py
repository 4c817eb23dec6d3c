"""HF ``architectures`` name -> model class, imported lazily."""

from __future__ import annotations

import importlib

# One table; the value is "module:Class".
_MODELS = {
    "LlamaForCausalLM": "sglang.srt.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(architectures: list[str] | None) -> str:
    """The first supported name in a config's ``architectures``; ValueError listing the known ones."""
    for name in architectures or []:
        if name in _MODELS:
            return name
    raise ValueError(f"unsupported model architecture {architectures!r}; supported: {supported_architectures()}")


def get_model_class(architecture: str):
    module_name, class_name = _MODELS[resolve_architecture([architecture])].split(":")
    return getattr(importlib.import_module(module_name), class_name)
