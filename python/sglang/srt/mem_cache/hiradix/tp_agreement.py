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

    ``more_groups``: further groups of ranks holding the same tree (the PP group under pipeline
    parallelism): the MIN runs over ``group`` and then over each of them, which gives the MIN
    over every rank of the grid (upstream syncs over the TP then the PP group the same way).
    ``num_calls`` counts agreements issued, so tests can check that ranks stayed in step.
    """

    def __init__(self, group=None, *more_groups):
        import torch.distributed as dist

        self.groups = [g for g in (group, *more_groups) if g is not None and dist.get_world_size(g) > 1]
        self.group = group
        self.world_size = 1
        for g in self.groups:
            self.world_size *= dist.get_world_size(g)
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
        for group in self.groups:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return t.tolist()

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank."""
        return self.min([1 if flag else 0])[0] == 1
