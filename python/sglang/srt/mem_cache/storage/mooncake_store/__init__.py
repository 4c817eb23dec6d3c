"""`--hicache-storage-backend mooncake`: L3 pages in a Mooncake store shared by many servers
(``mooncake_store.py``; configuration in ``mooncake_config.py``, the client in ``store_client.py``)."""
