"""Build a model from a ModelConfig and fill its weights (safetensors or dummy)."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from sglang.srt.choice_enum import ChoiceEnum
from sglang.srt.model_executor.model_config import ModelConfig
from sglang.srt.model_executor.weight_utils import (
    dummy_weights_iterator,
    safetensors_files,
    safetensors_weights_iterator,
)
from sglang.srt.model_executor.model_registry import get_model_class

logger = logging.getLogger(__name__)


class LoadFormat(ChoiceEnum):
    AUTO = "auto"  # safetensors, the only on-disk format supported
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"  # deterministic random weights from a seed; needs only config.json

    @classmethod
    def label(cls) -> str:
        return "load_format"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(model_config: ModelConfig, load_format="auto", device="cpu", seed: int = 0) -> torch.nn.Module:
    """The model on ``device`` in ``model_config.dtype``, weights loaded, in eval mode. Shards
    follow the current TP group. ``seed`` only matters for ``dummy``."""
    load_format = LoadFormat.parse(load_format)
    model_cls = get_model_class(model_config.architecture)
    start = time.perf_counter()
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_cls(model_config.hf_config)
    shapes = model_cls.hf_weight_shapes(model_config.hf_config)
    if load_format is LoadFormat.DUMMY:
        weights = dummy_weights_iterator(shapes, seed)
    else:
        weights = safetensors_weights_iterator(safetensors_files(model_config.model_path))
    with torch.no_grad():
        model.load_weights(weights)
    logger.info(
        "loaded %s (%s, %s weights, %s) in %.2fs",
        model_config.architecture,
        load_format.value,
        model_config.dtype,
        device,
        time.perf_counter() - start,
    )
    return model.eval()
