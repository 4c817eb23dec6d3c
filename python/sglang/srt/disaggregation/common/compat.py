"""The shape facts prefill and decode must agree on, and the check that refuses a mismatch.

``PeerInfo`` travels in the bootstrap registration (prefill) and in the decode's registration
with each prefill rank; both sides run ``check_peer_compat`` so a bad pairing fails at bootstrap,
before any byte moves, with a message naming both values.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from sglang.srt.disaggregation.base.conn import IncompatiblePeerError, KVArgs, StateType
from sglang.srt.disaggregation.common.rank_mapping import check_tp_pairing, check_tp_size, heads_per_rank


@dataclass(frozen=True)
class PeerInfo:
    """What one side's ranks look like. Lists are per buffer, as in KVArgs (bytes per item)."""

    tp_size: int
    page_size: int
    kv_dtype: str
    head_dim: int
    layer_num: int
    is_mla: bool
    total_kv_head_num: int
    kv_item_lens: tuple[int, ...]
    state_type: str
    state_item_lens: tuple[int, ...]
    state_dims: tuple[int, ...]
    aux_item_lens: tuple[int, ...]
    # rows per TP-sharded segment of every state buffer, flattened (buffer i's sum to state_dims[i])
    state_segments: tuple[int, ...] = ()

    @classmethod
    def from_kv_args(cls, args: KVArgs) -> "PeerInfo":
        return cls(
            tp_size=args.tp_size, page_size=args.page_size, kv_dtype=args.kv_dtype, head_dim=args.head_dim,
            layer_num=args.layer_num, is_mla=args.is_mla, total_kv_head_num=args.effective_total_kv_head_num,
            kv_item_lens=tuple(args.kv_item_lens), state_type=args.state_type.value,
            state_item_lens=tuple(args.state_item_lens), state_dims=tuple(args.state_dim_per_tensor),
            aux_item_lens=tuple(args.aux_item_lens),
            state_segments=tuple(r for seg in args.state_row_segments for r in seg),
        )

    def segments_per_buffer(self) -> list[tuple[int, ...]]:
        """``state_segments`` split per state buffer (one segment each when not given); raises
        ValueError when they do not add up to ``state_dims``."""
        return split_segments(self.state_segments, self.state_dims)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj) -> "PeerInfo":
        """Parse a dict from the wire; raise ValueError naming the bad field."""
        if not isinstance(obj, dict):
            raise ValueError(f"peer info must be an object, got {type(obj).__name__}")
        kwargs = {}
        for f in fields(cls):
            if f.name not in obj and f.default is not MISSING:
                continue
            if f.name not in obj:
                raise ValueError(f"peer info lacks field {f.name!r}")
            value = obj[f.name]
            if f.type.startswith("tuple"):
                if not isinstance(value, list) or not all(type(v) is int for v in value):
                    raise ValueError(f"peer info field {f.name!r} must be a list of ints, got {value!r}")
                value = tuple(value)
            elif not isinstance(value, {"int": int, "str": str, "bool": bool}[f.type]):
                raise ValueError(f"peer info field {f.name!r} must be {f.type}, got {value!r}")
            kwargs[f.name] = value
        StateType(kwargs["state_type"])
        info = cls(**kwargs)
        info.segments_per_buffer()
        return info


def split_segments(flat, dims) -> list[tuple[int, ...]]:
    """Flat segment rows -> one tuple per buffer, each summing to that buffer's ``dims`` entry
    (``flat`` empty: one segment per buffer). ValueError naming both when they do not fit."""
    if not flat:
        return [(d,) for d in dims]
    out, i = [], 0
    for d in dims:
        seg, total = [], 0
        while total < d and i < len(flat):
            seg.append(flat[i])
            total, i = total + flat[i], i + 1
        if total != d or min(seg, default=0) < 1:
            raise ValueError(f"state segments {list(flat)} do not split state dims {list(dims)}")
        out.append(tuple(seg))
    if i != len(flat):
        raise ValueError(f"state segments {list(flat)} do not split state dims {list(dims)}")
    return out


def _same(name: str, prefill, decode) -> None:
    if prefill != decode:
        raise IncompatiblePeerError(f"{name} mismatch: prefill {prefill!r} vs decode {decode!r}")


def check_peer_compat(prefill: PeerInfo, decode: PeerInfo) -> None:
    """Raise IncompatiblePeerError naming both values unless the pair can exchange KV."""
    for name in ("page_size", "kv_dtype", "head_dim", "layer_num", "is_mla", "state_type"):
        _same(name, getattr(prefill, name), getattr(decode, name))
    _same("number of KV buffers", len(prefill.kv_item_lens), len(decode.kv_item_lens))
    _same("number of state buffers", len(prefill.state_item_lens), len(decode.state_item_lens))
    _same("aux item bytes", prefill.aux_item_lens, decode.aux_item_lens)
    check_tp_pairing(prefill.tp_size, decode.tp_size)
    if prefill.is_mla:
        _same("KV item bytes", prefill.kv_item_lens, decode.kv_item_lens)
    else:
        _same("total_kv_head_num", prefill.total_kv_head_num, decode.total_kv_head_num)
        heads = prefill.total_kv_head_num
        check_tp_size(heads, prefill.tp_size, "prefill")
        check_tp_size(heads, decode.tp_size, "decode")
        hp, hd = heads_per_rank(heads, prefill.tp_size), heads_per_rank(heads, decode.tp_size)
        for i, (lp, ld) in enumerate(zip(prefill.kv_item_lens, decode.kv_item_lens)):
            if lp % hp or ld % hd or lp // hp != ld // hd:
                raise IncompatiblePeerError(
                    f"KV buffer {i} bytes per head mismatch: prefill {lp} B / {hp} heads vs decode {ld} B / {hd} heads"
                )
    for i, (sp, sd) in enumerate(zip(prefill.segments_per_buffer(), decode.segments_per_buffer())):
        if len(sp) != len(sd) or any(p * prefill.tp_size != d * decode.tp_size for p, d in zip(sp, sd)):
            raise IncompatiblePeerError(
                f"state buffer {i} TP segments mismatch: prefill {list(sp)} rows x tp {prefill.tp_size} vs "
                f"decode {list(sd)} rows x tp {decode.tp_size}"
            )
    for i, (lp, dp, ld, dd) in enumerate(zip(prefill.state_item_lens, prefill.state_dims, decode.state_item_lens,
                                             decode.state_dims)):
        if lp // dp != ld // dd:
            raise IncompatiblePeerError(
                f"state buffer {i} row bytes mismatch: prefill {lp} B / {dp} rows vs decode {ld} B / {dd} rows"
            )
        if dp * prefill.tp_size != dd * decode.tp_size:
            raise IncompatiblePeerError(
                f"state buffer {i} total rows mismatch: prefill {dp} x tp {prefill.tp_size} vs "
                f"decode {dd} x tp {decode.tp_size}"
            )
