"""Model configuration read from an HF-format directory's ``config.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from sglang.srt.model_executor.model_registry import get_model_class, resolve_architecture

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

def resolve_dtype(dtype: str, device: str | torch.device, config_dtype: str | None) -> torch.dtype:
    """``auto`` is float32 on CPU and the checkpoint's dtype (bfloat16 if unset) elsewhere."""
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        dtype = config_dtype if config_dtype in DTYPES else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {['auto', *DTYPES]}")
    return DTYPES[dtype]


@dataclass
class ModelConfig:
    """``hf_config`` holds every key of config.json (with HF defaults filled in) as attributes."""

    model_path: str
    architecture: str
    hf_config: SimpleNamespace
    dtype: torch.dtype
    context_len: int

    @classmethod
    def from_pretrained(
        cls, model_path: str, dtype: str = "auto", device: str = "cpu", context_length: int | None = None
    ) -> "ModelConfig":
        if not os.path.isdir(model_path):
            raise ValueError(f"model path {model_path!r} is not a directory")
        config_file = os.path.join(model_path, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"model path {model_path!r} has no config.json")
        with open(config_file) as f:
            raw = json.load(f)
        return cls.from_dict(raw, model_path, dtype, device, context_length)

    @classmethod
    def from_dict(cls, raw: dict, model_path: str = "", dtype="auto", device="cpu", context_length=None):
        architecture = resolve_architecture(raw.get("architectures"))
        hf = get_model_class(architecture).complete_hf_config(raw, f"config.json of {model_path!r}")
        max_pos = hf["max_position_embeddings"]
        if context_length is not None and not 0 < context_length <= max_pos:
            raise ValueError(f"context_length must be in [1, max_position_embeddings={max_pos}], got {context_length}")
        torch_dtype = resolve_dtype(dtype, device, raw.get("torch_dtype") or raw.get("dtype"))
        return cls(model_path, architecture, SimpleNamespace(**hf), torch_dtype, context_length or max_pos)

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def model_class(self):
        return get_model_class(self.architecture)

    def kv_pool_layout(self, tp_size: int):
        """The pools this model caches into at ``tp_size`` (``KVPoolLayout``)."""
        return self.model_class.kv_pool_layout(self.hf_config, tp_size, self.dtype)
