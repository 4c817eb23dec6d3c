"""Bounded requests on a real server started without keys: each request beyond a limit answers
400 naming the limit (and the server keeps serving); an oversized body is refused while it is
read; a rid is refused while a request with it is in flight, streaming or not, however many
arrive at once; the admin routes answer 403 on a server without --admin-api-key; mutations do
not answer GET."""

import json
import socket
import threading

import pytest
import requests

from sglang.srt.entrypoints.http_common import MAX_BODY_BYTES, MAX_JSON_DEPTH
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=15, suite="per-commit-cpu")

GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    # an empty key is no key (as upstream); named explicitly so a launcher default cannot add one
    srv = launch_server_process(model, "--context-length", "1024", "--max-total-tokens", "4096", "--admin-api-key", "")
    try:
        yield srv
    finally:
        srv.stop()


def check_400(resp: requests.Response, *words: str) -> None:
    assert resp.status_code == 400, resp.text[:500]
    message = resp.json()["error"]["message"]
    for w in words:
        assert w in message, message


def still_serving(server) -> None:
    assert server.generate(**GEN)["meta_info"]["completion_tokens"] == 2


def post_raw(server, body: bytes, path: str = "/generate") -> requests.Response:
    return requests.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path, body, words", [
    ("/generate", {**GEN, "return_logprob": True, "top_logprobs_num": 10**9}, ["top_logprobs_num", "20"]),
    ("/generate", {**GEN, "return_logprob": True, "top_logprobs_num": 10**30}, ["top_logprobs_num"]),
    ("/v1/completions", {**COMPLETION, "logprobs": 10**9}, ["logprobs", "20"]),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 10**9}, ["top_logprobs", "20"]),
    ("/generate", {**GEN, "sampling_params": {"stop": ["x"] * 100_000}}, ["stop", "100000", "64"]),
    ("/generate", {**GEN, "sampling_params": {"stop": "y" * 5000}}, ["stop", "1024"]),
    ("/v1/completions", {**COMPLETION, "stop": [str(i) for i in range(65)]}, ["stop", "64"]),
    ("/generate", {**GEN, "sampling_params": {"stop_token_ids": [1] * 5000}}, ["stop_token_ids", "1024"]),
    ("/generate", {**GEN, "sampling_params": {"n": 10**9}}, ["n=", "limit is 1"]),
    ("/v1/completions", {**COMPLETION, "n": 10**9}, ["n=", "limit is 1"]),
    ("/v1/chat/completions", {**CHAT, "n": 10**9}, ["n=", "limit is 1"]),
])
def test_limits_name_themselves(server, path, body, words):
    check_400(server.post(path, body), *words)
    still_serving(server)


@pytest.mark.parametrize("path, raw, words", [
    ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": %s}}' % (b"9" * 5000), ["4300 digits"]),
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": 1%s}}' % (b"0" * 400), ["temperature", "64-bit"]),
    ("/generate", b'{"text": "x", "sampling_params": {"sampling_seed": %d}}' % 2**64, ["sampling_seed", "64-bit"]),
    ("/generate", b'{"text": "x", "sampling_params": {"stop_token_ids": [%d]}}' % 2**70, ["stop_token_ids"]),
    ("/v1/completions", b'{"prompt": "x", "seed": %d}' % 2**64, ["64-bit"]),
    ("/generate", b'{"text": "x", "return_logprob": true, "logprob_start_len": %d}' % 2**64, ["logprob_start_len"]),
])
def test_huge_integers_are_400(server, path, raw, words):
    check_400(post_raw(server, raw, path), *words)
    still_serving(server)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deep_json_is_400(server, depth):
    nested = b"[" * depth + b"]" * depth
    check_400(post_raw(server, b'{"text": "x", "sampling_params": {"stop": %s}}' % nested), "deeper",
              str(MAX_JSON_DEPTH))
    still_serving(server)


def _send_request_head(sock: socket.socket, extra: str) -> None:
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
                 "\r\n".encode())


def _read_response(sock: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_declared_oversized_body_is_refused_before_it_is_sent(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        _send_request_head(sock, f"Content-Length: {MAX_BODY_BYTES + 1}\r\n")
        status, body = _read_response(sock)  # no body byte was sent
    assert status == 400 and str(MAX_BODY_BYTES) in body, body
    still_serving(server)


def test_oversized_chunked_body_is_refused_while_it_is_read(server):
    """A chunked body one byte over the limit that never ends: refused once the limit is passed
    (a server that buffered the whole body first would wait for the end forever)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        _send_request_head(sock, "Transfer-Encoding: chunked\r\n")
        piece, left = b"a" * (1 << 20), MAX_BODY_BYTES + 1
        while left:
            data = piece[:left]
            sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            left -= len(data)
        status, body = _read_response(sock)  # the terminating chunk is never sent
    assert status == 400 and str(MAX_BODY_BYTES) in body, body
    still_serving(server)


@pytest.mark.parametrize("stream", [True, False])
def test_one_rid_at_a_time_however_many_arrive_together(server, stream):
    rid, n = f"dup-{stream}", 8
    body = {"input_ids": [3] * 8, "rid": rid, "stream": stream,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    barrier, results = threading.Barrier(n), []

    def one():
        barrier.wait()
        resp = requests.post(server.url + "/generate", json=body, timeout=120)
        results.append((resp.status_code, resp.text))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(code for code, _ in results)
    assert codes == [200] + [400] * (n - 1), results
    assert all(rid in text and "in use" in text for code, text in results if code == 400)
    ok = next(text for code, text in results if code == 200)
    assert ("data: [DONE]" in ok) if stream else json.loads(ok)["meta_info"]["completion_tokens"] == 200
    assert server.generate(**{**GEN, "rid": rid})["meta_info"]["id"] == rid  # free again once it finished


@pytest.mark.parametrize("method, path", [
    ("POST", "/flush_cache"), ("POST", "/attach_hicache_storage_backend"), ("PUT", "/hicache/storage-backend"),
    ("POST", "/detach_hicache_storage_backend"), ("DELETE", "/hicache/storage-backend"),
    ("GET", "/hicache_storage_backend"), ("GET", "/info_from_hicache_storage_backend"),
    ("GET", "/hicache/storage-backend"), ("POST", "/hicache/storage-backend/clear"),
])
def test_admin_routes_are_refused_without_an_admin_key(server, method, path):
    for headers in (None, {"Authorization": "Bearer anything"}):
        resp = requests.request(method, server.url + path, headers=headers, json={}, timeout=30)
        assert resp.status_code == 403 and "--admin-api-key" in resp.json()["error"]["message"], resp.text


def test_flush_cache_does_not_answer_get(server):
    assert server.get("/flush_cache").status_code == 405
    assert server.get("/generate").status_code == 405
