"""Client helpers for the runtime L3 attach / detach routes (shared by the attach tests). The
routes need the admin key: start the server with ``*ADMIN_FLAGS``; the helpers send ``ADMIN``."""

import json
import time

PROMPT_IDS = list(range(10, 50))  # 40 tokens = 10 pages of 4
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 60.0
CALL_TIMEOUT_S = 30.0  # a rank out of step hangs the server: fail fast instead
ADMIN_KEY = "test-admin-key"
ADMIN_FLAGS = ("--admin-api-key", ADMIN_KEY)
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def status(server) -> dict:
    resp = server.get("/hicache_storage_backend", headers=ADMIN)
    assert resp.status_code == 200, resp.text
    return resp.json()


def file_config(path, **extra) -> str:
    return json.dumps({"storage_dir": str(path), "prefetch_threshold": 4, **extra})


def attach(server, backend="file", extra=None, **fields):
    body = {"hicache_storage_backend": backend, **fields}
    if extra is not None:
        body["hicache_storage_backend_extra_config_json"] = extra
    return server.post("/attach_hicache_storage_backend", body, timeout=CALL_TIMEOUT_S, headers=ADMIN)


def detach(server):
    return server.post("/detach_hicache_storage_backend", timeout=CALL_TIMEOUT_S, headers=ADMIN)


def until_not_busy(call):
    """Repeat ``call`` while it answers 409 (transfers of the last request still in flight)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        resp = call()
        if resp.status_code != 409 or time.monotonic() > end:
            return resp
        time.sleep(0.05)


def flush(server):
    resp = until_not_busy(lambda: server.post("/flush_cache", timeout=CALL_TIMEOUT_S, headers=ADMIN))
    assert resp.status_code == 200, resp.text


def storage_hit(server, reference) -> int:
    """Tokens of PROMPT_IDS reused from L3; the greedy output must equal ``reference``."""
    out = server.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY, timeout=CALL_TIMEOUT_S)
    assert out["output_ids"] == reference
    return out["meta_info"]["cached_tokens_details"]["storage"]
