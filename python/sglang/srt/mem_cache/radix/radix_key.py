"""RadixKey: a run of token ids (one contiguous int64 array) and the namespace it lives in.

Keys are compared in bulk (``common_prefix_len``, a memcmp then one vectorised compare) and
sliced as views, so matching a prompt against the tree never loops over tokens in Python.
A key wraps the caller's array without copying when it is already int64; the tree copies the
ids of the keys it keeps (``RadixKey.copy``), so a caller may reuse its buffer afterwards.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from sglang.srt.mem_cache.radix.page_hash import hash_page, namespace_hash

TOKEN_DTYPE = np.int64


def as_token_array(token_ids) -> np.ndarray:
    """``token_ids`` (a sequence of ints, an integer ndarray or tensor) as a read-only 1-D int64
    array; a view when it already is one. TypeError for non-integer ids, ValueError for ndim != 1."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
        if arr.dtype != TOKEN_DTYPE:
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"token ids must be integers, got an array of {arr.dtype}")
            arr = arr.astype(TOKEN_DTYPE)
    else:
        try:
            arr = np.asarray(token_ids)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"token ids must be a sequence of ints: {exc}") from None
        if arr.size == 0:
            arr = np.empty(arr.shape, dtype=TOKEN_DTYPE)
        elif arr.dtype.kind not in "iu":
            raise TypeError(f"token ids must be ints, got {arr.dtype} values")
        if arr.dtype != TOKEN_DTYPE:
            arr = arr.astype(TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {tuple(arr.shape)}")
    view = arr.view()
    view.flags.writeable = False
    return view


def common_prefix_len(a: np.ndarray, b: np.ndarray, page_size: int) -> int:
    """Leading tokens ``a`` and ``b`` share, rounded down to whole pages (units: tokens)."""
    n = min(a.shape[0], b.shape[0]) // page_size * page_size
    if n == 0 or np.array_equal(a[:n], b[:n]):
        return n
    first = int(np.flatnonzero(a[:n] != b[:n])[0])
    return first // page_size * page_size


class RadixKey:
    """Token ids of a request prefix and the namespace they live in.

    ``extra_key`` separates namespaces (LoRA id, tenant ``cache_salt``): equal tokens under
    different extra keys never match each other. ``ids`` is the read-only int64 array the tree
    works on; ``token_ids`` a list copy of it and iteration yields Python ints (for tests,
    messages and upstream-style callers, not for hot paths). ``key[i]`` is the one-token key
    at ``i`` and ``key[a:b]`` a view, both in the same namespace (upstream's indexing).
    """

    __slots__ = ("ids", "extra_key", "_head")

    def __init__(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, extra_key: str | None = None):
        if extra_key is not None and not isinstance(extra_key, str):
            raise TypeError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
        self.ids = as_token_array(token_ids)
        self.extra_key = extra_key
        self._head = None

    @classmethod
    def _wrap(cls, ids: np.ndarray, extra_key: str | None) -> "RadixKey":
        key = cls.__new__(cls)
        key.ids, key.extra_key, key._head = ids, extra_key, None
        return key

    @property
    def token_ids(self) -> list[int]:
        return self.ids.tolist()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids.tolist())

    def __getitem__(self, item: int | slice) -> "RadixKey":
        """A view of tokens ``item`` (a slice of step 1) or the one-token key at index ``item``
        (negative counts from the end); IndexError out of range."""
        if isinstance(item, slice):
            if item.step not in (None, 1):
                raise ValueError(f"RadixKey slices take step 1, got {item.step}")
            return RadixKey._wrap(self.ids[item], self.extra_key)
        if not isinstance(item, (int, np.integer)) or isinstance(item, bool):
            raise TypeError(f"RadixKey indices are ints or slices, got {type(item).__name__}")
        n = self.ids.shape[0]
        i = int(item) + n if item < 0 else int(item)
        if not 0 <= i < n:
            raise IndexError(f"RadixKey index {int(item)} out of range for {n} tokens")
        return RadixKey._wrap(self.ids[i : i + 1], self.extra_key)

    def __eq__(self, other) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.extra_key == other.extra_key and np.array_equal(self.ids, other.ids)

    def __hash__(self) -> int:
        return hash((self.extra_key, self.ids.tobytes()))

    def __repr__(self) -> str:
        head = self.ids[:8].tolist()
        more = "..." if len(self) > 8 else ""
        return f"RadixKey(len={len(self)}, ids={head}{more}, extra_key={self.extra_key!r})"

    def copy(self) -> "RadixKey":
        """A key owning its own (read-only) copy of the ids."""
        ids = self.ids.copy()
        ids.flags.writeable = False
        return RadixKey._wrap(ids, self.extra_key)

    def hash_page(self, start: int, end: int, prior_hash: str | None = None) -> str:
        """Page hash of tokens ``[start, end)`` chained from ``prior_hash``, or from this key's
        namespace seed when None (so equal tokens in two namespaces hash apart)."""
        if not 0 <= start <= end <= len(self):
            raise IndexError(f"hash_page range [{start}, {end}) out of bounds for {len(self)} tokens")
        seed = namespace_hash(self.extra_key) if prior_hash is None else prior_hash
        return hash_page(seed, self.ids[start:end])

    def page(self, index: int, page_size: int) -> tuple[int, ...]:
        """Tokens of page ``index`` (page units)."""
        return tuple(self.ids[index * page_size : (index + 1) * page_size].tolist())

    def child_key(self, pos: int, page_size: int) -> tuple[str | None, bytes]:
        """What a tree files the child starting at token ``pos`` under: namespace and page bytes
        (kept for ``pos == 0``: a node's own filing key is asked for on every lock walk)."""
        if pos:
            return self.extra_key, self.ids[pos : pos + page_size].tobytes()
        head = self._head
        if head is None or head[0] != page_size:
            head = self._head = (page_size, (self.extra_key, self.ids[:page_size].tobytes()))
        return head[1]
