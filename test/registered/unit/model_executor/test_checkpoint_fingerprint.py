"""The checkpoint fingerprint (the model identity of the L3 namespace): equal for the same bytes
at another path, different for a changed byte in any tensor's sampled range, a changed config or
another dummy seed; reads bounded by the headers plus 8 KiB per tensor."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from sglang.srt.model_executor import checkpoint_fingerprint as cf
from sglang.srt.model_executor.checkpoint_fingerprint import (
    SAMPLE_BYTES,
    checkpoint_fingerprint,
    compute_fingerprint,
    storage_model_name,
)
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 1000}
# 16 KiB (head and tail sampled), exactly 8 KiB (read whole), 40 bytes (read whole), 1 MiB
TENSORS = {"big": (4096,), "edge": (2048,), "small": (10,), "huge": (512, 512)}


def write_checkpoint(path, shards: int = 1, seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in TENSORS.items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return str(path)


def tensor_span(file: str, name: str) -> tuple[int, int]:
    """(file offset, length) of tensor ``name``'s data."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(header_len))[name]["data_offsets"]
    return 8 + header_len + begin, end - begin


def header_length(file: str) -> int:
    with open(file, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def flip_byte(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))


def fp(path, load_format="auto", seed=0) -> str:
    return compute_fingerprint(str(path), load_format, seed).digest


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "a")


def test_the_same_checkpoint_at_another_path_has_the_same_fingerprint(ckpt, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "elsewhere" / "renamed")
    # key order and whitespace of config.json do not count; tokenizer and other files do not either
    with open(os.path.join(copy, "config.json"), "w") as f:
        json.dump(dict(reversed(list(CONFIG.items()))), f)
    with open(os.path.join(copy, "generation_config.json"), "w") as f:
        f.write("{}")
    assert fp(copy) == fp(ckpt)
    assert len(fp(ckpt)) == 64 and int(fp(ckpt), 16) >= 0
    # auto and safetensors load the same files; the seed does not count for them
    assert fp(ckpt, "safetensors", 7) == fp(ckpt)


@pytest.mark.parametrize("name", sorted(TENSORS))
@pytest.mark.parametrize("where", ["head", "tail"])
def test_one_byte_in_the_middle_of_any_sampled_range_changes_it(ckpt, name, where):
    before = fp(ckpt)
    file = os.path.join(ckpt, "model.safetensors")
    offset, length = tensor_span(file, name)
    sampled = min(length, SAMPLE_BYTES)
    start = offset if where == "head" else offset + length - sampled
    flip_byte(file, start + sampled // 2)
    assert fp(ckpt) != before


def test_a_byte_outside_the_sampled_ranges_is_not_seen(ckpt):
    """The documented limit: an edit inside a large tensor, between its sampled ends, with the
    header unchanged, keeps the fingerprint (docs/storage_keys.md)."""
    before = fp(ckpt)
    file = os.path.join(ckpt, "model.safetensors")
    offset, length = tensor_span(file, "huge")
    flip_byte(file, offset + length // 2)
    assert fp(ckpt) == before


def test_config_header_and_file_changes_change_it(ckpt, tmp_path):
    base = fp(ckpt)
    other = shutil.copytree(ckpt, tmp_path / "b")
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump({**CONFIG, "rope_theta": 10000.0}, f)
    assert fp(other) != base
    # another seed: other weights of the same shapes
    assert fp(write_checkpoint(tmp_path / "c", seed=1)) != base
    # a renamed tensor (header only)
    renamed = tmp_path / "d"
    os.makedirs(renamed)
    shutil.copy(os.path.join(ckpt, "config.json"), renamed)
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    tensors["bigger"] = tensors.pop("big")
    save_file(tensors, os.path.join(renamed, "model.safetensors"))
    assert fp(renamed) != base
    # the same tensors, sharded: other file names and headers
    assert fp(write_checkpoint(tmp_path / "e", shards=2)) != base


def test_dummy_weights_are_the_config_and_the_seed(ckpt, tmp_path):
    other = shutil.copytree(ckpt, tmp_path / "copy")
    os.remove(os.path.join(other, "model.safetensors"))  # dummy reads no weight file
    assert fp(ckpt, "dummy", 0) == fp(other, "dummy", 0)
    assert fp(ckpt, "dummy", 1) != fp(ckpt, "dummy", 0)
    assert fp(ckpt, "dummy", 0) != fp(ckpt)
    assert compute_fingerprint(ckpt, "dummy", 0).bytes_read == len(json.dumps(CONFIG, separators=(",", ":")))


def test_bytes_read_are_bounded_by_headers_and_8_KiB_per_tensor(tmp_path, monkeypatch):
    path = write_checkpoint(tmp_path / "sharded", shards=2)
    preads = []
    real_pread = os.pread

    def counting_pread(fd, n, offset):
        data = real_pread(fd, n, offset)
        preads.append(len(data))
        return data

    monkeypatch.setattr(cf.os, "pread", counting_pread)
    result = compute_fingerprint(path, "auto", 0)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    headers = sum(8 + header_length(os.path.join(path, f)) for f in files)
    tensor_bytes = sum(4 * torch.Size(s).numel() for s in TENSORS.values())
    expected = headers + sum(min(4 * torch.Size(s).numel(), 2 * SAMPLE_BYTES) for s in TENSORS.values())
    assert (result.num_files, result.num_tensors) == (2, len(TENSORS))
    assert sum(preads) == expected  # exactly: 8 + 8 KiB + 40 + 8 KiB of tensor data
    assert sum(preads) <= headers + 2 * SAMPLE_BYTES * len(TENSORS) < tensor_bytes // 20
    assert result.bytes_read == expected + len(json.dumps(CONFIG, separators=(",", ":")))


def test_a_malformed_or_missing_file_is_a_value_error_naming_it(ckpt, tmp_path):
    file = os.path.join(ckpt, "model.safetensors")
    with open(file, "r+b") as f:
        f.write((10**12).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="model.safetensors: safetensors header length"):
        fp(ckpt)
    with pytest.raises(ValueError, match="config.json"):
        fp(tmp_path / "nowhere", "dummy")
    os.makedirs(tmp_path / "empty")
    shutil.copy(os.path.join(ckpt, "config.json"), tmp_path / "empty")
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        fp(tmp_path / "empty")


def test_the_storage_model_name_is_the_name_and_16_hex_digits_computed_once(ckpt, monkeypatch):
    checkpoint_fingerprint.cache_clear()
    args = ServerArgs(model_path=ckpt)
    name = storage_model_name(args)
    assert name == f"a@{fp(ckpt)[:16]}"
    assert args.model_name == "a"  # user-facing name unchanged
    monkeypatch.setattr(cf.os, "pread", lambda *a: pytest.fail("fingerprint computed twice"))
    assert storage_model_name(ServerArgs(model_path=ckpt)) == name
    served = ServerArgs(model_path=ckpt, served_model_name="final", load_format="dummy", random_seed=3)
    monkeypatch.undo()
    assert storage_model_name(served) == f"final@{fp(ckpt, 'dummy', 3)[:16]}"
    checkpoint_fingerprint.cache_clear()
