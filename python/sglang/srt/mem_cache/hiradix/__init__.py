"""The hierarchical tree's parts: how nodes leave a tier (eviction), the L3 side (prefetch and
backup), the Mamba state beside stored KV, and TP agreement on locally observed numbers."""
