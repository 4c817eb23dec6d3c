"""PD KV transfer over Mooncake's transfer engine (``--disaggregation-transfer-backend mooncake``)."""
