"""LayerDoneCounter: layer-by-layer load-back, so attention on layer i waits only for layer i.

The controller (producer) copies a batch's host pages to the device one layer at a time and
records one event per layer. The model runner (consumer) sets the batch's producer index as
the consumer, and every device pool read of local layer i calls ``wait_until(i)``: compute of
layer i overlaps the copy of layers i+1, i+2, ...

Three event sets rotate (triple buffering) so the loads of the next batches can be issued while
the current batch still computes; reusing a set first waits for its previous load to finish.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.controller.transfer_lane import CpuEvent, HiCacheTransferError

logger = logging.getLogger(__name__)

NUM_EVENT_SETS = 3


def _new_event(lane):
    return CpuEvent(armed=False) if lane is None else lane.new_event(armed=False)


class LayerLoadingEvent:
    """One event per layer of one load batch (``load_events``), made by ``lane`` (a transfer
    lane; None: CPU events, recorded by whoever calls ``complete``)."""

    def __init__(self, num_layers: int, lane=None):
        self.num_layers = num_layers
        self.load_events = [_new_event(lane) for _ in range(num_layers)]

    @property
    def finish_event(self):
        """The last layer's event: the whole batch has arrived once it is recorded."""
        return self.load_events[-1]

    def arm(self) -> None:
        for ev in self.load_events:
            ev.arm()

    def complete(self, layer: int) -> None:
        """Producer: layer ``layer`` (pool-local) has been copied."""
        self.load_events[layer].record()

    def wait(self, layer: int) -> None:
        """Consumer: wait until layer ``layer`` has been copied (raises if the copy failed)."""
        self.load_events[layer].wait()

    def finished(self) -> bool:
        return self.finish_event.query()

    def synchronize(self) -> None:
        """Wait until the batch is done; a failure is reported through the load ack, not here."""
        try:
            self.finish_event.synchronize()
        except HiCacheTransferError:
            pass


class LayerDoneCounter:
    """Producer/consumer indices over ``NUM_EVENT_SETS`` LayerLoadingEvents.

    Mutates only its indices and event sets. ``wait_until`` with no consumer set returns at once.
    ``lane``: the transfer lane that records the events (the controller's load lane); None
    (upstream's one-argument form) makes CPU events.
    """

    def __init__(self, num_layers: int, lane=None):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.events = [LayerLoadingEvent(num_layers, lane) for _ in range(NUM_EVENT_SETS)]
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self) -> int:
        """Take the next event set for a new load batch and return its index.

        Blocks until that set's previous load (three batches ago) has finished.
        """
        nxt = (self.producer_index + 1) % NUM_EVENT_SETS
        self.events[nxt].synchronize()
        self.events[nxt].arm()
        self.producer_index = nxt
        return nxt

    def set_consumer(self, index: int) -> None:
        """The batch about to run loads through event set ``index`` (-1: nothing to wait for)."""
        if not -1 <= index < NUM_EVENT_SETS:
            raise ValueError(f"consumer index must be in [-1, {NUM_EVENT_SETS}), got {index}")
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        """Wait until local layer ``threshold`` of the consumer's batch has arrived."""
        if self.consumer_index < 0:
            return
        if not 0 <= threshold < self.num_layers:
            raise ValueError(f"layer {threshold} outside [0, {self.num_layers})")
        self.events[self.consumer_index].wait(threshold)

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1
