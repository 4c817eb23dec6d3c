"""Helpers shared by the serving benchmarks: the tokenizer, server-sent event lines, auth
headers and the client session."""

from __future__ import annotations

import os


class BenchTokenizer:
    """The tokenizer of a local model directory with the methods benchmark scripts call on a
    Hugging Face tokenizer: ``encode``, ``decode``, ``vocab_size``, ``get_vocab``,
    ``apply_chat_template``, ``bos_token`` / ``eos_token``."""

    def __init__(self, model_dir: str):
        from sglang.srt.tokenizer import get_tokenizer as load

        self._inner = load(model_dir)
        self.name_or_path = model_dir
        self.bos_token = self._inner.bos_token
        self.eos_token = self._inner.eos_token
        self.bos_token_id = self._inner.bos_token_id
        ids = self._inner.eos_token_ids
        self.eos_token_id = ids[0] if ids else None

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return self._inner._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._inner.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            **_unused):
        text = self._inner.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def get_tokenizer(pretrained_model_name_or_path: str, **_unused) -> BenchTokenizer:
    """The tokenizer of a local model directory (or of its ``tokenizer.json``), offline.
    ValueError when the path holds no tokenizer.json (hub names are not fetched)."""
    path = pretrained_model_name_or_path
    if os.path.isfile(path) and os.path.basename(path) == "tokenizer.json":
        path = os.path.dirname(path) or "."
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"tokenizer {pretrained_model_name_or_path!r}: no tokenizer.json there; pass a local model "
                         "directory (--tokenizer or --model); hub names are not downloaded")
    return BenchTokenizer(path)


def remove_prefix(text: str, prefix: str) -> str:
    return text[len(prefix):] if text.startswith(prefix) else text


def remove_suffix(text: str, suffix: str) -> str:
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


def get_auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $OPENAI_API_KEY`` when that variable is set."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


BENCH_TIMEOUT_S = 6 * 60 * 60
BENCH_READ_BUFSIZE = 10 << 20  # one SSE line can be long (cumulative text)


def create_bench_client_session():
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BENCH_TIMEOUT_S),
                                 read_bufsize=BENCH_READ_BUFSIZE)


_create_bench_client_session = create_bench_client_session  # upstream's name


def sse_data(line: bytes) -> str | None:
    """The payload of one server-sent event line (``data: ...``), None for other lines."""
    text = line.strip().decode("utf-8")
    if not text.startswith("data:"):
        return None
    return remove_prefix(remove_prefix(text, "data:"), " ")
