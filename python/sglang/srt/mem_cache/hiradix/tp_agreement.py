"""TPAgreement: the one way TP ranks sharing a tree agree on a locally observed number.

Every decision that could differ between ranks (host slots available, transfers finished,
device slots for a load-back) is reduced with MIN over a dedicated gloo group before the tree
acts on it, so every rank's tree stays identical. Callers make the same calls on every rank
whatever happens locally: a local failure is contributed as a value (0, a negative margin),
never by skipping the call, so no rank can leave another waiting in a collective.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


class TPAgreement:
    """All-reduce MIN of small int vectors over ``group`` (a gloo group; None: a single rank).

    ``num_calls`` counts collectives issued, so tests can check that ranks stayed in step.
    """

    def __init__(self, group=None):
        self.group = group
        self.world_size = 1
        if group is not None:
            import torch.distributed as dist

            self.world_size = dist.get_world_size(group)
        self.num_calls = 0

    def min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of ``values`` over the ranks (``values`` itself on one rank).

        Every rank must pass a vector of the same length. Raises whatever the collective raises
        (a peer that died surfaces as an error here, not as a hang, given a group timeout).
        """
        self.num_calls += 1
        if self.world_size == 1:
            return list(map(int, values))
        values = [int(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank."""
        return self.min([1 if flag else 0])[0] == 1
