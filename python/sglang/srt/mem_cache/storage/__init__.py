"""L3 storage backends (file, NIXL) and the factory that builds them by name.

Nothing here imports NIXL until a NIXL backend is built.
"""
