"""Two requests with one rid arriving in the same event-loop turn, driven through the real app
(``create_app``) and the real TokenizerManager over ASGI, with a stand-in scheduler that answers
each request with one token: the rid is taken before any response starts, so exactly one reaches
the scheduler and the other answers 400 naming the rid, streaming or not (before the fix a
streaming request took its rid only when its body generator first ran, after the other
request's handler had already passed the check)."""

import asyncio
import json
import queue
import threading
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.managers.io_struct import BatchOutput, ReqOutput, TokenizedGenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import make_tiny_model

register_cpu_ci(est_time=5, suite="per-commit-cpu")


class EchoScheduler:
    """Answers every request with token 1 and ``finish: length``; records the rids it got."""

    def __init__(self, in_queue: queue.Queue, out_queue: queue.Queue):
        self.rids: list[str] = []
        self.in_queue, self.out_queue = in_queue, out_queue
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            msg = self.in_queue.get()
            if isinstance(msg, TokenizedGenerateReqInput):
                self.rids.append(msg.rid)
                self.out_queue.put([BatchOutput([ReqOutput(msg.rid, [1], finish={"type": "length"})])])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")


@pytest.fixture
def app_and_scheduler(model):
    """A fresh app per test: its output reader thread belongs to that test's event loop."""
    args = ServerArgs(model_path=model)
    info = {"context_len": 512, "vocab_size": 1000, "max_total_num_tokens": 2048}
    in_queue, out_queue = queue.Queue(), queue.Queue()
    tm = TokenizerManager(args, info, in_queue, out_queue)
    engine = SimpleNamespace(tokenizer_manager=tm, args=args, info=info, alive=True)
    engine.start = tm.start
    return create_app(engine), tm, EchoScheduler(in_queue, out_queue)


async def post(app, path: str, body: dict) -> tuple[int, bytes]:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    delivered, status, chunks = False, [], []

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status[0], b"".join(chunks)


@pytest.mark.parametrize("path, body", [
    ("/generate", {"input_ids": [5, 6, 7], "stream": True}),
    ("/generate", {"input_ids": [5, 6, 7], "stream": False}),
    ("/v1/completions", {"prompt": [5, 6, 7], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
def test_same_rid_in_one_loop_turn_reaches_the_scheduler_once(app_and_scheduler, path, body):
    app, tm, scheduler = app_and_scheduler
    rid = f"twin-{path}-{body['stream']}"
    body = {**body, "rid": rid}

    async def both():
        tm.start(asyncio.get_running_loop())
        return await asyncio.wait_for(asyncio.gather(post(app, path, body), post(app, path, body)), 20)

    results = asyncio.run(both())
    assert sorted(code for code, _ in results) == [200, 400], results
    refused = next(text for code, text in results if code == 400).decode()
    assert rid in refused and "in use" in refused
    assert scheduler.rids.count(rid) == 1
    assert rid not in tm.rid_to_state  # released once answered
