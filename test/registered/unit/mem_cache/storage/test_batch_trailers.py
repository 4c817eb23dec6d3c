"""batch_trailers: the batch-built trailers are byte for byte those of integrity.pack_trailer, and
the batch check accepts exactly the trailers read_trailer + page_is_whole accept."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.storage import batch_trailers
from sglang.srt.mem_cache.storage.integrity import pack_trailer, page_digest, page_is_whole, read_trailer
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

names_st = st.text(alphabet="0123456789abcdef._kv", min_size=1, max_size=80)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(names_st, st.integers(0, 2**40), u64, u64), min_size=1, max_size=8),
       st.sampled_from([64, 128, 4096]))
def test_build_equals_pack_trailer(rows, trailer_bytes):
    names, lengths, sums, digests = map(list, zip(*rows))
    built = batch_trailers.build(names, lengths, sums, digests, trailer_bytes)
    assert built.shape == (len(rows), trailer_bytes) and built.dtype == np.uint8
    for row, (name, n, c, d) in zip(built, rows):
        assert bytes(row) == pack_trailer(name, n, c, d, trailer_bytes)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_digests_are_page_digests(objects_per_page, rnd):
    sums = [rnd.getrandbits(64) for _ in range(sum(objects_per_page))]
    expected, i = [], 0
    for n in objects_per_page:
        expected += [page_digest(sums[i : i + n])] * n
        i += n
    assert batch_trailers.digests(sums, objects_per_page) == expected


def test_checksums_match_integrity():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 5000, dtype=np.uint8), rng.integers(0, 256, 300, dtype=np.uint8)
    from sglang.srt.mem_cache.storage.integrity import payload_checksum

    assert batch_trailers.checksums([[a], [a, b], [b]]) == [payload_checksum([a]), payload_checksum([a, b]),
                                                            payload_checksum([b])]


def test_matches_rejects_every_single_byte_flip():
    """A trailer read back is accepted by the batch check iff it is the valid one: flipping any
    byte (padding, header, CRC) fails it, and the per-object path agrees."""
    payload = np.arange(1000, dtype=np.uint32).view(np.uint8)
    (c,) = batch_trailers.checksums([[payload]])
    digests = batch_trailers.digests([c], [1])
    valid = batch_trailers.build(["obj_k"], [payload.nbytes], [c], digests, 64)
    assert batch_trailers.matches(valid.copy(), valid).tolist() == [True]
    assert page_is_whole([read_trailer(bytes(valid[0]), "obj_k", [payload], payload.nbytes)])
    for i in range(64):
        bad = valid.copy()
        bad[0, i] ^= 0x01
        assert batch_trailers.matches(bad, valid).tolist() == [False]
        result = read_trailer(bytes(bad[0]), "obj_k", [payload], payload.nbytes)
        assert result is None or not page_is_whole([result])


def test_verify_accepts_exactly_the_built_trailer_every_byte_checked():
    """verify() (header compare + zero-padding test, no padding built) agrees with matches()
    against build() for every single-byte flip, on 64-byte rows inside a wider read buffer (the
    file backend's tails) and on 4096-byte aligned rows (NIXL's staging slots)."""
    payload = np.arange(700, dtype=np.uint32).view(np.uint8)
    (c,) = batch_trailers.checksums([[payload]])
    digests = batch_trailers.digests([c, c], [1, 1])
    args = (["obj_a", "obj_b"], [payload.nbytes] * 2, [c, c], digests)
    for width, buffer_width in ((64, 65), (4096, 4096)):
        valid = batch_trailers.build(*args, width)
        buf = np.zeros((2, buffer_width), dtype=np.uint8)
        buf[:, :width] = valid
        assert batch_trailers.verify(buf[:, :width], *args).tolist() == [True, True]
        for i in list(range(0, width, 7)) + list(range(width - 64, width)):
            bad = buf.copy()
            bad[1, i] ^= 0x80
            assert batch_trailers.verify(bad[:, :width], *args).tolist() == [True, False], (width, i)
