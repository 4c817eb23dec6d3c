"""Weight sources: safetensors files of an HF directory, or deterministic random tensors."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's safetensors files: those named by the sharded index if there is one,
    else every ``*.safetensors`` in the directory. ValueError when none (or a shard) is missing."""
    index_file = os.path.join(model_path, SAFETENSORS_INDEX)
    if os.path.isfile(index_file):
        with open(index_file) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, n) for n in names]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"{index_file} names shard files that do not exist: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {model_path!r} (only safetensors checkpoints are supported; "
            "use load_format='dummy' for random weights)"
        )
    return files


def safetensors_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` file by file, one tensor in memory at a time."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dummy_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fp32 tensor that depends only on (seed, name, shape): norms near 1, biases small,
    matrices with std 1/sqrt(fan_in)."""
    gen = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise
    return noise / shape[-1] ** 0.5


def dummy_weights_iterator(shapes: dict[str, tuple[int, ...]], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in shapes.items():
        yield name, dummy_weight(name, shape, seed)
