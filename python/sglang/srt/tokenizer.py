"""Tokenizer of an HF-format model directory: ``tokenizer.json`` through the ``tokenizers``
library, special tokens from tokenizer_config.json / generation_config.json / config.json, and
the chat template (HF Jinja, rendered in a sandbox; ChatML when the model has none)."""

from __future__ import annotations

import json
import os
from datetime import datetime

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _read_json(model_path: str, name: str) -> dict:
    path = os.path.join(model_path, name)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class HFTokenizer:
    def __init__(self, model_path: str):
        from tokenizers import Tokenizer

        path = os.path.join(model_path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"no tokenizer.json in {model_path!r} (a tokenizers-library file is required)")
        self._tok = Tokenizer.from_file(path)
        tok_cfg = _read_json(model_path, "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template or DEFAULT_CHAT_TEMPLATE
        self.bos_token = _token_text(tok_cfg.get("bos_token"))
        self.eos_token = _token_text(tok_cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = _as_list(_read_json(model_path, "generation_config.json").get("eos_token_id"))
        eos_ids += _as_list(_read_json(model_path, "config.json").get("eos_token_id"))
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos_ids.append(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = sorted(set(eos_ids))
        self._compiled_template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": str, "content": str}, ...]) to the prompt text."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{'role': str, 'content': str}}, got {m!r}")
        return self._template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def _template(self):
        if self._compiled_template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(f"chat template error: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"invalid chat template: {exc}") from None
        return self._compiled_template


def get_tokenizer(model_path: str) -> HFTokenizer:
    return HFTokenizer(model_path)
