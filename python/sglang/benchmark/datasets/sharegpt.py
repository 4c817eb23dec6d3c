"""ShareGPT conversations from a local JSON file (no download: there may be no internet)."""

from __future__ import annotations

import json
import logging
import os
import random

from sglang.benchmark.datasets.common import DatasetRow

logger = logging.getLogger(__name__)


def load_sharegpt_pairs(dataset_path: str) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with two turns or more, shuffled
    with ``random``. ValueError when the file is missing or is not a ShareGPT list."""
    if not dataset_path or not os.path.isfile(dataset_path):
        raise ValueError(f"ShareGPT dataset {dataset_path!r} not found; pass --dataset-path to a local ShareGPT "
                         "JSON file (nothing is downloaded), or use random prompts (random_sample=False)")
    with open(dataset_path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{dataset_path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations", item.get("conversation", [])) if isinstance(item, dict) else []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.shuffle(pairs)
    return pairs


def sample_sharegpt_requests(dataset_path: str, num_requests: int, tokenizer, fixed_output_len: int | None = None,
                             context_len: int | None = None, prompt_suffix: str | None = "",
                             apply_chat_template: bool = False) -> list[DatasetRow]:
    """Up to ``num_requests`` conversations as requests; output length is the reply's tokens
    unless ``fixed_output_len``. Pairs shorter than 2 tokens or over ``context_len`` are skipped."""
    if fixed_output_len is not None and fixed_output_len < 4:
        raise ValueError(f"fixed_output_len must be >= 4, got {fixed_output_len}")
    rows: list[DatasetRow] = []
    for prompt, reply in load_sharegpt_pairs(dataset_path):
        if len(rows) == num_requests:
            break
        if prompt_suffix:
            prompt += prompt_suffix
        if apply_chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt_len = len(tokenizer.encode(prompt))
        output_len = len(tokenizer.encode(reply)) if fixed_output_len is None else fixed_output_len
        if prompt_len < 2 or output_len < 2 or (context_len and prompt_len + output_len > context_len):
            continue
        rows.append(DatasetRow(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    logger.info("sharegpt: %d requests, %d input tokens", len(rows), sum(r.prompt_len for r in rows))
    return rows
