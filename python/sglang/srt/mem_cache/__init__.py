"""Hierarchical KV cache: device pools (L1), host pools (L2), storage (L3) and the radix tree.

Importing this package is cheap: it pulls in neither NIXL, the HTTP stack nor a model.
"""
