"""Prefill/decode disaggregation: KV transfer between a prefill server and a decode server.

``base`` holds the interfaces, ``common`` the transport-free parts (bootstrap server, rank
mapping, head slicing, peer checks, control channel) and ``nixl`` the NIXL transfer engine.
Importing this package pulls in neither NIXL nor ZMQ.
"""
