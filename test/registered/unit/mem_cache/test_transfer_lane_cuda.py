"""Transfer lanes and the layer-done counter on a GPU: a lane is a CUDA stream, events are CUDA
events, and a consumer's wait is a stream wait (the host does not block).

On CPU the same controller code runs with worker threads and threading events
(test_layer_done_counter.py); these are the stream semantics it relies on. Order is made
deterministic by keeping a stream busy (``torch.cuda._sleep``) rather than by timing: work
queued behind a busy stream cannot have run yet.
"""

import pytest

from sglang.test.cuda import require_cuda

require_cuda()

import torch  # noqa: E402
from tree_fixtures import make_hicache, start_request  # noqa: E402

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.controller.layer_done_counter import NUM_EVENT_SETS, LayerDoneCounter  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.controller.transfer_lane import CudaEvent, HiCacheTransferError, StreamLane, make_lane  # noqa: E402
from sglang.srt.mem_cache.radix.tree_node import RadixKey  # noqa: E402
from sglang.test.ci.ci_register import register_cuda_ci  # noqa: E402

register_cuda_ci(est_time=15, suite="per-commit-1-gpu")

SPIN = int(2e9)  # about a second of a busy stream: far longer than the host work in between


def test_a_cuda_lane_is_a_stream_and_its_jobs_run_on_it():
    lane = make_lane("test", "cuda")
    assert isinstance(lane, StreamLane) and isinstance(lane.new_event(), CudaEvent)
    seen = []
    lane.submit(lambda: seen.append(torch.cuda.current_stream()), [])
    assert seen == [lane.stream] and torch.cuda.current_stream() != lane.stream


def test_a_job_runs_after_the_work_queued_before_it_on_the_current_stream():
    lane = make_lane("test", "cuda")
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.zeros_like(x)
    torch.cuda._sleep(SPIN)
    x.fill_(7)  # queued on the current stream, behind the spin
    lane.submit(lambda: y.copy_(x), [])
    lane.synchronize()
    assert bool((y == 7).all()), "the lane copied before the current stream's work ran"


def test_waiting_on_a_lane_event_orders_the_stream_not_the_host():
    lane = make_lane("test", "cuda")
    ev = lane.new_event()
    y = torch.zeros(1 << 20, device="cuda")

    def job():
        torch.cuda._sleep(SPIN)
        y.fill_(5)
        ev.record()

    lane.submit(job, [ev])
    assert not ev.query()
    ev.wait()  # the current stream waits; the host goes on
    assert not ev.query(), "wait() blocked the host until the copy finished"
    z = y.clone()  # on the current stream, after the event
    torch.cuda.synchronize()
    assert ev.query() and bool((z == 5).all())


def test_a_failed_job_fails_its_pending_events_only():
    """As transfer_lane documents: a job that raises fails every event it was given that it has
    not recorded yet; waiters raise instead of hanging, and recorded events stay good."""
    lane = make_lane("test", "cuda")
    done, pending = lane.new_event(), lane.new_event()

    def job():
        done.record()
        raise OSError("injected copy failure")

    lane.submit(job, [done, pending])
    assert isinstance(lane.error, OSError)
    assert pending.query() and isinstance(pending.error, OSError)
    with pytest.raises(HiCacheTransferError, match="injected copy failure"):
        pending.wait()
    with pytest.raises(HiCacheTransferError):
        pending.synchronize()
    assert done.error is None
    done.wait()
    done.synchronize()


def test_event_sets_rotate_and_a_reused_set_waits_for_its_last_load():
    lane = make_lane("test", "cuda")
    counter = LayerDoneCounter(2, lane)
    order = []
    for _ in range(NUM_EVENT_SETS + 1):
        idx = counter.update_producer()  # reusing set 0 first waits for its load
        if len(order) == NUM_EVENT_SETS:
            assert counter.events[idx].finished()
        order.append(idx)
        events = counter.events[idx]

        def job(events=events):
            torch.cuda._sleep(SPIN // 8)
            for layer in range(2):
                events.complete(layer)

        lane.submit(job, events.load_events)
    assert order == [0, 1, 2, 0]
    lane.synchronize()


class FailingHost(MHATokenToKVPoolHost):
    """A real host pool whose load of layer 1 fails."""

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend=None):
        if layer_id == 1:
            raise OSError("injected copy failure")
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)


def test_failed_layer_copy_raises_in_the_waiter_and_on_check_on_cuda():
    """The CUDA twin of test_layer_done_counter's failure test: layer 0 arrived and is usable,
    the wait for layer 1 raises, and the agreed check raises."""
    tokens = [1, 2, 3, 4]
    h = make_hicache(page_size=2, device_pages=8, host_pages=8, host_cls=FailingHost, layer_num=4, device="cuda")
    h.cache_finished_req(start_request(h, tokens))
    h.cache_controller.synchronize()
    h.check_hicache_events()
    assert h.evict(EvictParams(num_tokens=100)).num_tokens_evicted == len(tokens)
    pool = h.token_to_kv_pool_allocator.get_kvcache()
    m = h.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    h.init_load_back(m.last_host_node, m.host_hit_length)
    counter = h.cache_controller.layer_done_counter
    counter.set_consumer(h.ready_to_load_host_cache())
    pool.get_key_buffer(0)
    with pytest.raises(HiCacheTransferError, match="injected copy failure"):
        pool.get_key_buffer(1)
    with pytest.raises(HiCacheTransferError, match="failed on at least one TP rank"):
        h.check_hicache_events()
    counter.set_consumer(-1)
    h.cache_controller.close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_an_armed_event_whose_job_was_not_submitted_is_not_done():
    ev = CudaEvent(armed=True)  # torch's own query() answers True before any record
    assert not ev.query()
    with pytest.raises(RuntimeError, match="never submitted"):
        ev.synchronize()
    with pytest.raises(RuntimeError, match="never submitted"):
        ev.wait()
    ev.record()
    ev.synchronize()
    assert ev.query()
