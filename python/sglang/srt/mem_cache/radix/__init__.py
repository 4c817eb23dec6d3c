"""The radix tree's vocabulary: keys, nodes, page hashes, match reuse, request bookkeeping and
the slot-accounting checks that both trees run."""
