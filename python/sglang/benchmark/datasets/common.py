"""DatasetRow: one benchmark request, what every sampler returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DatasetRow:
    """One request: ``prompt`` (text, or token ids), its length in tokens and the tokens to
    generate. Unpacks like the older ``(prompt, prompt_len, output_len)`` tuples."""

    prompt: Any
    prompt_len: int
    output_len: int
    image_data: Any = None
    timestamp: float | None = None
    extra_request_body: dict = field(default_factory=dict)

    def _as_tuple(self) -> tuple:
        return (self.prompt, self.prompt_len, self.output_len)

    def __iter__(self):
        return iter(self._as_tuple())

    def __getitem__(self, index):
        return self._as_tuple()[index]

    def __len__(self) -> int:
        return 3
