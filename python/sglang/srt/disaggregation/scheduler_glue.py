"""What the Scheduler calls when the server runs in a disaggregation mode.

``build_disaggregation(scheduler)`` (the factory the engine hands to each scheduler process;
the scheduler never imports this package) returns None in null mode, else a ``PrefillDisagg`` or
a ``DecodeDisagg`` (``prefill.py``, ``decode.py``; their shared part is ``DisaggBase`` in
``common/scheduler_side.py``) with this interface, which the scheduler calls at a few points and
which calls back into it (``enqueue``, ``_finish``, ``_cache_unfinished``):

- ``add_request(req, msg) -> bool``: take a new request into the PD queues (True) or leave it
  to the normal waiting queue (False; never in these modes);
- ``step()``: at the start of every scheduler step, poll the queues and move requests on;
- ``intercept_finish(req) -> bool``: the scheduler is about to finish ``req``; True keeps it
  (prefill: its KV is being sent, the pages stay held until the transfer ends);
- ``abort(rid) -> bool``: drop a request held in the PD queues;
- ``held_reqs()``: requests in the PD queues that hold device pages (integrity, reservations);
- ``has_work()``, ``info()``, ``close()``.

Every TP rank runs the same calls on the same messages, and acts on transfer states only after
``agreed_polls`` made them the same on every rank, so all ranks keep identical pools.
"""

from __future__ import annotations


def build_disaggregation(scheduler):
    """The PD helper of ``scheduler`` for its ``--disaggregation-mode`` (None in null mode)."""
    mode = getattr(scheduler.args, "disaggregation_mode", "null")
    if mode == "prefill":
        from sglang.srt.disaggregation.prefill import PrefillDisagg

        return PrefillDisagg(scheduler)
    if mode == "decode":
        from sglang.srt.disaggregation.decode import DecodeDisagg

        return DecodeDisagg(scheduler)
    return None
