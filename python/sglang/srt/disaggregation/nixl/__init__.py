"""PD KV transfer over NIXL (UCX): manager, sender, receiver, bootstrap server."""
