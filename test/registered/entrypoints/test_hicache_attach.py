"""Runtime L3 attach / detach on a real HiCache server started without storage: refused while a
request runs, accepted when idle; after attach the cache really uses L3 (a flushed prefix comes
back from storage) and after detach it does not; greedy outputs stay token-identical
throughout; a failed attach (bad name, bad config, failing constructor) leaves what was there.
Directories live under the server's ``--hicache-storage-roots`` (``roots``)."""

import json
import threading

import pytest
import requests
from admin_client import (ADMIN_FLAGS, DEADLINE_S, GREEDY, PROMPT_IDS, attach, detach, file_config, flush, status,
                          storage_hit, until_not_busy)

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=15, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return tmp_path_factory.mktemp("l3roots")


@pytest.fixture(scope="module")
def server(tmp_path_factory, roots):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    srv = launch_server_process(model, "--enable-hierarchical-cache", "--page-size", "4", "--context-length", "4096",
                                "--max-total-tokens", "2048", "--hicache-storage-roots", str(roots), *ADMIN_FLAGS)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(server):
    """Greedy output before any attach (the server is fresh)."""
    return server.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)["output_ids"]


def test_starts_detached(server, reference):
    assert status(server)["hicache_storage_backend"] is None
    assert detach(server).status_code == 200  # idempotent


def test_bad_attach_requests_leave_nothing_attached(server, reference, roots):
    blocker = roots / "a_plain_file"
    blocker.write_text("")
    cases = [
        (attach(server, "nope"), "not allowed"),
        (attach(server, "file", json.dumps({"no_such_key": 1})), "no_such_key"),
        (attach(server, "file", "{not json"), "hicache_storage_backend_extra_config_json"),
        (attach(server, "file", file_config(roots), hicache_storage_prefetch_policy="sometimes"), "sometimes"),
        (attach(server, "file", typo=1), "typo"),
        (attach(server, "file", json.dumps({"storage_dir": str(blocker / "sub")})), "a_plain_file"),  # ctor fails
    ]
    for resp, needle in cases:
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], resp.text
    assert status(server)["hicache_storage_backend"] is None
    assert storage_hit(server, reference) == 0


def test_attach_refused_while_a_request_runs(server, reference, roots):
    first_chunk, done = threading.Event(), threading.Event()

    def long_stream():
        body = {"input_ids": [7] * 16, "sampling_params": {"max_new_tokens": 1500, "temperature": 0,
                                                           "ignore_eos": True}, "stream": True}
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data: {"):
                    first_chunk.set()
        done.set()

    worker = threading.Thread(target=long_stream, daemon=True)
    worker.start()
    assert first_chunk.wait(DEADLINE_S)
    resp = attach(server, "file", file_config(roots / "busy"))
    assert not done.is_set(), "the long request ended before the check; make it longer"
    assert resp.status_code == 409 and "not idle" in resp.json()["error"]["message"], resp.text
    assert status(server)["hicache_storage_backend"] is None
    worker.join(DEADLINE_S)
    assert done.is_set()


def test_attach_when_idle_then_serving_uses_storage(server, reference, roots):
    l3 = roots / "l3"
    resp = until_not_busy(lambda: attach(server, "file", file_config(l3),
                                         hicache_storage_prefetch_policy="wait_complete"))
    assert resp.status_code == 200 and "attached" in resp.text, resp.text
    st = status(server)
    assert st["hicache_storage_backend"] == "file" and json.loads(st["hicache_storage_backend_extra_config"]) == {
        "storage_dir": str(l3), "prefetch_threshold": 4}
    assert st["hicache_storage_prefetch_policy"] == "wait_complete"
    flush(server)
    assert storage_hit(server, reference) == 0  # computed again, written through to host and L3
    flush(server)  # drops device and host; L3 keeps the pages
    assert storage_hit(server, reference) > 0
    assert any(l3.rglob("*")), "the file backend wrote nothing"


def test_failed_attach_keeps_the_attached_backend(server, reference, roots):
    assert status(server)["hicache_storage_backend"] == "file"
    again = attach(server, "file", file_config(roots / "other"))  # checked before idleness
    assert again.status_code == 409 and "already attached" in again.json()["error"]["message"]
    bad = attach(server, "dynamic", json.dumps({"module_path": "no.such.module", "class_name": "X"}))
    assert bad.status_code == 403, bad.text  # refused before anything else: no module is named by a request
    assert status(server)["hicache_storage_backend"] == "file"
    flush(server)
    assert storage_hit(server, reference) > 0  # the first backend still serves


def test_detach_when_idle_then_no_storage(server, reference):
    resp = until_not_busy(lambda: detach(server))
    assert resp.status_code == 200 and "detached" in resp.text, resp.text
    assert status(server)["hicache_storage_backend"] is None
    flush(server)
    assert storage_hit(server, reference) == 0
    flush(server)
    assert storage_hit(server, reference) == 0  # nothing comes back from L3 any more
    assert server.get("/health").status_code == 200  # idle integrity checks passed throughout
