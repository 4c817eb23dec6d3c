"""HF ``architectures`` name -> model class, imported lazily.

It lives beside the model runner (upstream keeps it in ``models/registry.py``) so that
``model_executor`` never imports ``models``: the table names classes as "module:Class" strings.
"""

from __future__ import annotations

import importlib

# One table; the value is "module:Class".
_MODELS = {
    "LlamaForCausalLM": "sglang.srt.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3:Qwen3ForCausalLM",
    "DeepseekV4ForCausalLM": "sglang.srt.models.deepseek_v4:DeepseekV4ForCausalLM",
    "Qwen3NextForCausalLM": "sglang.srt.models.qwen3_next:Qwen3NextForCausalLM",
    "MiMoV2FlashForCausalLM": "sglang.srt.models.mimo_v2_flash:MiMoV2FlashForCausalLM",
    "DeepseekV2ForCausalLM": "sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "sglang.srt.models.deepseek_v2:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "sglang.srt.models.deepseek_v32:DeepseekV32ForCausalLM",
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
