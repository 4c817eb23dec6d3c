"""Detokenization of one request's output: the text so far, stop strings cut, stream deltas.

The whole output is decoded each time (outputs are short here); a trailing U+FFFD (an
incomplete UTF-8 sequence) is held back from stream deltas until the next token completes it.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.sent_chars = 0

    def text(self, output_ids: list[int], finish: dict | None = None) -> str:
        """The output text; when a stop string ended it, cut just before that string."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=self.skip_special_tokens)
        matched = (finish or {}).get("matched")
        if isinstance(matched, str) and matched in self.stop:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def delta(self, output_ids: list[int], finish: dict | None = None) -> str:
        """Text not returned by earlier calls (everything left once ``finish`` is set)."""
        text = self.text(output_ids, finish)
        end = len(text)
        if finish is None:
            while end > self.sent_chars and text[end - 1] == "\ufffd":
                end -= 1
        out = text[self.sent_chars : end]
        self.sent_chars = max(self.sent_chars, end)
        return out
