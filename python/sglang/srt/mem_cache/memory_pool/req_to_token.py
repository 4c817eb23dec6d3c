"""ReqToTokenPool: request slot -> the token slots of that request's KV, position by position."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A table ``req_to_token`` of shape (size, max_context_len), int32, on ``device``.

    Row ``r`` belongs to one running request; ``req_to_token[r, p]`` is the device token slot
    holding the KV of its token at position ``p``. The scheduler writes the prefix slots (from
    the radix match) and ``ForwardBatch`` writes the slots of the tokens it computes. Request
    slots are handed out lowest-first, so runs are reproducible.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"size and max_context_len must be >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self.clear()

    def available_size(self) -> int:
        return len(self._free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        """Take ``need_size`` request slots (lowest first); None when fewer are free."""
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size > len(self._free_slots):
            return None
        self._free_slots.sort()
        taken, self._free_slots = self._free_slots[:need_size], self._free_slots[need_size:]
        for r in taken:
            self._in_use[r] = True
        return taken

    def free(self, free_index: int | list[int]) -> None:
        """Return request slots. ValueError on out-of-range or already-free slots (nothing freed)."""
        slots = [free_index] if isinstance(free_index, int) else list(free_index)
        for r in slots:
            if not 0 <= r < self.size:
                raise ValueError(f"request slot {r} out of range [0, {self.size})")
            if not self._in_use[r]:
                raise ValueError(f"double free: request slot {r} is not in use")
        if len(set(slots)) != len(slots):
            raise ValueError(f"request slots freed twice in one call: {slots}")
        for r in slots:
            self._in_use[r] = False
        self._free_slots.extend(slots)

    def write(self, indices, values) -> None:
        """``req_to_token[indices] = values``; e.g. ``indices=(r, slice(start, end))``."""
        self.req_to_token[indices] = torch.as_tensor(values, dtype=torch.int32, device=self.device)

    def clear(self) -> None:
        self._free_slots = list(range(self.size))
        self._in_use = [False] * self.size
