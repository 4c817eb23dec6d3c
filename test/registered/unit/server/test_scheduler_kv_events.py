"""The scheduler hands each step's KV events to the publisher the engine built from
``--kv-events-config``: a finished request's pages arrive as ``BlockStored``, a flush as
``AllBlocksCleared``; without the flag the tree records nothing."""

import json

import pytest
import torch
from scheduler_fixtures import make_scheduler, prompts, request

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EventPublisherFactory,
    KVEventBatch,
    NullEventPublisher,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=6, suite="per-commit-cpu")

PAGE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


class RecordingPublisher(NullEventPublisher):
    """A null publisher that keeps what it was given."""

    def __init__(self, config: str):
        super().__init__()
        self.config = json.loads(config)
        self.batches: list[KVEventBatch] = []

    def publish(self, events):
        super().publish(events)
        self.batches.append(events)


def run(sched, req) -> None:
    sched.handle_messages([req])
    for _ in range(200):
        sched.step()
        if not sched.has_work():
            return
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("hicache", [False, True])
def test_steps_publish_the_pages_the_tree_took(model, hicache):
    torch.set_num_threads(1)
    extra = dict(enable_hierarchical_cache=True, hicache_ratio=4) if hicache else {}
    config = '{"publisher": "null", "topic": "kv"}'
    args = ServerArgs(model_path=model, page_size=PAGE, max_total_tokens=64 * PAGE, kv_events_config=config, **extra)
    sched = Scheduler(args, kv_events_factory=RecordingPublisher)
    pub = sched.kv_event_publisher
    assert pub.config == {"publisher": "null", "topic": "kv"} and sched.tree_cache.kv_events is not None
    ids = prompts(1, 3 * PAGE, seed=3)[0]
    run(sched, request("a", ids, max_new=2))
    events = [e for b in pub.batches for e in b.events]
    assert all(b.ts > 0 for b in pub.batches)
    assert events[0] == AllBlocksCleared()  # the tree's start
    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    # the prompt's three pages (the last decoded token makes no whole page)
    assert [tuple(e.token_ids) for e in gpu[:3]] == [tuple(ids[i : i + PAGE]) for i in range(0, 3 * PAGE, PAGE)]
    assert gpu[1].parent_block_hash == gpu[0].block_hashes[0] and gpu[0].parent_block_hash is None
    before = len(pub.batches)
    assert sched.flush_cache().ok
    assert pub.batches[before:] and pub.batches[-1].events[-1] == AllBlocksCleared()
    sched.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish(KVEventBatch(ts=0.0, events=[]))


def test_without_the_flag_nothing_is_recorded(model):
    sched = make_scheduler(model, page_size=PAGE, max_total_tokens=64 * PAGE)
    assert sched.kv_event_publisher is None and sched.tree_cache.kv_events is None
    sched.shutdown()


def test_the_flag_needs_the_engines_factory(model):
    args = ServerArgs(model_path=model, page_size=PAGE, max_total_tokens=64 * PAGE, kv_events_config="{}")
    with pytest.raises(ValueError, match="kv_events_factory"):
        Scheduler(args)
    sched = Scheduler(args, kv_events_factory=EventPublisherFactory.create)
    assert isinstance(sched.kv_event_publisher, NullEventPublisher)
    sched.shutdown()
