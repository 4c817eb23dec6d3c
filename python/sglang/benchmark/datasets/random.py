"""Random-length requests: token ids drawn from the vocabulary, or cut from ShareGPT prompts."""

from __future__ import annotations

import numpy as np

from sglang.benchmark.datasets.common import DatasetRow


def _lengths(length: int, range_ratio: float, num: int, minimum: int) -> list[int]:
    """``num`` lengths uniform in [max(length * range_ratio, minimum), length] (numpy's RNG)."""
    low = max(int(length * range_ratio), minimum)
    return [int(x) for x in np.random.randint(min(low, length), length + 1, size=num)]


def _from_sharegpt(dataset_path: str, tokenizer, input_lens: list[int]) -> list[list[int]]:
    from sglang.benchmark.datasets.sharegpt import load_sharegpt_pairs

    out = []
    for prompt, _ in load_sharegpt_pairs(dataset_path):
        if len(out) == len(input_lens):
            break
        ids = tokenizer.encode(prompt)
        if not ids:
            continue
        need = input_lens[len(out)]
        out.append((ids * (need // len(ids) + 1))[:need])  # repeat, then cut to the length
    if len(out) < len(input_lens):
        raise ValueError(f"{dataset_path}: only {len(out)} usable prompts, {len(input_lens)} needed")
    return out


def sample_random_requests(input_len: int, output_len: int, num_prompts: int, range_ratio: float, tokenizer,
                           dataset_path: str = "", random_sample: bool = True,
                           return_text: bool = True) -> list[DatasetRow]:
    """``num_prompts`` requests with input lengths in [input_len * range_ratio, input_len] and
    output lengths in [output_len * range_ratio, output_len] tokens.

    ``random_sample``: cut the prompts from ShareGPT (``dataset_path``, a local file); else
    consecutive token ids from a random offset in the vocabulary. ``return_text``: the prompt
    is decoded text, else the token ids (Python ints)."""
    if num_prompts < 0 or input_len < 1 or output_len < 0:
        raise ValueError(f"need num_prompts >= 0, input_len >= 1, output_len >= 0; got {num_prompts}, "
                         f"{input_len}, {output_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    input_lens = _lengths(input_len, range_ratio, num_prompts, 1)
    output_lens = _lengths(output_len, range_ratio, num_prompts, 0)
    if random_sample:
        prompts = _from_sharegpt(dataset_path, tokenizer, input_lens)
    else:
        vocab = tokenizer.vocab_size
        offsets = np.random.randint(0, vocab, size=num_prompts)
        prompts = [[int(offsets[i] + i + j) % vocab for j in range(n)] for i, n in enumerate(input_lens)]
    rows = [DatasetRow(prompt=tokenizer.decode(ids) if return_text else ids, prompt_len=n, output_len=m)
            for ids, n, m in zip(prompts, input_lens, output_lens)]
    print(f"#Input tokens: {sum(input_lens)}")
    print(f"#Output tokens: {sum(output_lens)}")
    return rows
