"""Reuse a request's prefix match across scheduler steps while the tree has not changed under it.

A waiting request is matched again at every admission attempt (and, under ``lpm``, at every
ordering of the queue). ``match_prefix_reusing`` answers from the previous match when nothing
it depends on moved: the same tree (no reset), every node the match walked unchanged since
then (``TreeNode.stamp``), and still no child under the last walked node for the key's next
page (the only way a match could now go deeper). Checking costs one comparison per walked node
and one dict lookup, whatever the prompt length. A reused match refreshes the walked nodes'
access time and count exactly as a fresh match would, so eviction order does not depend on
whether a match was reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix.radix_key import RadixKey
from sglang.srt.mem_cache.radix.tree_node import TreeNode, new_stamp


@dataclass
class ReusableMatch:
    """``result`` of matching ``key`` on the tree whose root was ``root``, taken at clock
    ``stamp``; ``walked``: tokens the match walked (units: tokens, whole pages);
    ``next_child``: the filing key of the page after them (None when no whole page is left)."""

    key: RadixKey
    result: MatchResult
    root: TreeNode
    stamp: int
    walked: int
    next_child: tuple | None

    def is_current(self, tree) -> bool:
        """Would ``tree.match_prefix(MatchPrefixParams(key=self.key))`` return the same result now?"""
        if self.root is not tree.root_node:
            return False
        path = self.result.path
        for node in path:
            if node.stamp >= self.stamp:
                return False
        end = path[-1] if path else self.root
        return self.next_child is None or self.next_child not in end.children


def match_prefix_reusing(tree, key: RadixKey, previous: ReusableMatch | None) -> ReusableMatch:
    """``previous`` when it matched this same ``key`` object and is current (its nodes are
    touched as by a match); else a fresh ``tree.match_prefix(key)``. The result is read-only:
    callers must not modify its tensors in place."""
    if previous is not None and previous.key is key and previous.is_current(tree):
        tree.touch(previous.result.path)
        return previous
    result = tree.match_prefix(MatchPrefixParams(key=key))
    walked, page = sum(len(n.key) for n in result.path), tree.page_size
    next_child = key.child_key(walked, page) if walked + page <= len(key) else None
    return ReusableMatch(key, result, tree.root_node, new_stamp(), walked, next_child)
