"""Request samplers for the serving benchmark: each returns a list of ``DatasetRow``.

``get_dataset(args, tokenizer)`` picks the sampler named by ``--dataset-name`` from one table.
Nothing is downloaded: ShareGPT-based samplers read a local ``--dataset-path``.
"""

from __future__ import annotations

from sglang.benchmark.datasets.common import DatasetRow


def _random(args, tokenizer, return_text: bool = True) -> list[DatasetRow]:
    from sglang.benchmark.datasets.random import sample_random_requests

    return sample_random_requests(
        input_len=args.random_input_len, output_len=args.random_output_len, num_prompts=args.num_prompts,
        range_ratio=args.random_range_ratio, tokenizer=tokenizer, dataset_path=args.dataset_path,
        random_sample=bool(args.dataset_path), return_text=return_text,
    )


def _sharegpt(args, tokenizer) -> list[DatasetRow]:
    from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests

    return sample_sharegpt_requests(
        dataset_path=args.dataset_path, num_requests=args.num_prompts, tokenizer=tokenizer,
        fixed_output_len=args.sharegpt_output_len, context_len=args.sharegpt_context_len,
        apply_chat_template=args.apply_chat_template,
    )


DATASETS = {
    "random": _random,
    "random-ids": lambda args, tok: _random(args, tok, return_text=False),
    "sharegpt": _sharegpt,
}


def get_dataset(args, tokenizer) -> list[DatasetRow]:
    """The requests ``args.dataset_name`` asks for; ValueError naming the known datasets."""
    try:
        sampler = DATASETS[args.dataset_name]
    except KeyError:
        raise ValueError(f"--dataset-name {args.dataset_name!r} is not known; choose one of: "
                         f"{', '.join(DATASETS)}") from None
    return sampler(args, tokenizer)
