"""A server started with both keys and an L3 backend whose extra config holds credentials, over
real HTTP: which key opens which route, mutations POST-only, no secret in any response or in
the log, and a runtime attach that can neither import a module a request names nor place
storage outside the storage roots (nothing is imported, nothing is created)."""

import json
import os

import pytest
import requests

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.engine_utils import REPO_ROOT, make_tiny_model
from sglang.test.server_utils import launch_server_process

register_cpu_ci(est_time=12, suite="per-commit-cpu")

API_KEY = "api-key-value-1"
ADMIN_KEY = "admin-key-value-2"
ACCESS_KEY = "AKIAEXAMPLEACCESS"
SECRET_KEY = "wJalrXUtnFEMI-secret-value"
URL_PASSWORD = "pw-in-url-123"
SECRETS = (API_KEY, ADMIN_KEY, ACCESS_KEY, SECRET_KEY, URL_PASSWORD)
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BACKEND = {"module_path": "secret_backend", "class_name": "SecretFileBackend"}
CREDENTIALS = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
               "endpoint": f"https://user:{URL_PASSWORD}@objects.example:9000"}
GENERATE = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
ADMIN_ROUTES = [("POST", "/flush_cache"), ("POST", "/attach_hicache_storage_backend"),
                ("PUT", "/hicache/storage-backend"), ("POST", "/detach_hicache_storage_backend"),
                ("DELETE", "/hicache/storage-backend"), ("GET", "/hicache_storage_backend"),
                ("GET", "/info_from_hicache_storage_backend"), ("GET", "/hicache/storage-backend"),
                ("POST", "/hicache/storage-backend/clear")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("security")
    roots, outside = base / "roots", base / "outside"
    roots.mkdir()
    outside.mkdir()
    return {"roots": roots, "outside": outside, "marker": base / "imported.marker"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, dirs):
    model = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
    here = os.path.dirname(os.path.abspath(__file__))  # secret_backend.py, import_marker.py
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(REPO_ROOT, "python"), here]),
           "SGLANG_TEST_IMPORT_MARKER": str(dirs["marker"])}
    startup = {**BACKEND, **CREDENTIALS, "storage_dir": str(dirs["roots"] / "startup"), "prefetch_threshold": 4}
    srv = launch_server_process(model, "--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "1024",
                                "--hicache-storage-backend", "dynamic",
                                "--hicache-storage-backend-extra-config", json.dumps(startup),
                                "--hicache-storage-roots", str(dirs["roots"]), "--api-key", API_KEY,
                                "--admin-api-key", ADMIN_KEY, env=env)
    try:
        yield srv
    finally:
        srv.stop()


def call(server, method: str, path: str, headers=None, body=None) -> requests.Response:
    return requests.request(method, server.url + path, json=body, headers=headers, timeout=60)


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked: {text[:2000]}"


def attach(server, extra: dict) -> requests.Response:
    body = {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config_json": extra}
    return call(server, "POST", "/attach_hicache_storage_backend", ADMIN, body)


def test_inference_routes_need_the_api_key(server):
    assert call(server, "POST", "/generate", body=GENERATE).status_code == 401
    wrong = call(server, "POST", "/generate", {"Authorization": "Bearer nope"}, GENERATE)
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
    assert call(server, "POST", "/generate", ADMIN, GENERATE).status_code == 401  # the admin key is not the api key
    assert call(server, "POST", "/generate", API, GENERATE).status_code == 200
    assert call(server, "GET", "/v1/models").status_code == 401
    assert call(server, "GET", "/v1/models", API).status_code == 200
    for open_path in ("/health", "/metrics"):  # probes and scrapers, as upstream
        assert call(server, "GET", open_path).status_code == 200


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_admin_routes_need_the_admin_key(server, method, path):
    for headers in (None, API, {"Authorization": "Bearer " + ADMIN_KEY[:-1] + "x"}, {"Authorization": ADMIN_KEY}):
        resp = call(server, method, path, headers)
        assert resp.status_code == 401, (headers, resp.text)
        assert_no_secret(resp.text)


@pytest.mark.parametrize("path", ["/flush_cache", "/attach_hicache_storage_backend", "/detach_hicache_storage_backend",
                                  "/hicache/storage-backend/clear"])
def test_mutations_do_not_answer_get(server, path):
    # no route takes GET here, so the request is an ordinary one (the api key) and then a 405
    assert call(server, "GET", path, API).status_code == 405


def test_no_secret_in_server_info_or_storage_status(server):
    info = call(server, "GET", "/get_server_info", API)
    assert info.status_code == 200
    assert_no_secret(info.text)
    body = info.json()
    assert body["api_key"] == body["admin_api_key"] == "***"
    assert json.loads(body["hicache_storage_backend_extra_config"])["secret_key"] == "***"
    for path in ("/hicache_storage_backend", "/hicache/storage-backend"):
        status = call(server, "GET", path, ADMIN)
        assert status.status_code == 200 and status.json()["hicache_storage_backend"] == "dynamic"
        assert_no_secret(status.text)
        extra = json.loads(status.json()["hicache_storage_backend_extra_config"])
        assert extra["access_key"] == "***" and extra["endpoint"] == "https://***@objects.example:9000"


def test_dynamic_attach_never_imports_a_module_the_request_names(server, dirs):
    assert call(server, "POST", "/detach_hicache_storage_backend", ADMIN).status_code == 200
    resp = attach(server, {"module_path": "import_marker", "class_name": "Anything",
                           "storage_dir": str(dirs["roots"] / "x")})
    assert resp.status_code == 403 and "never names a module" in resp.json()["error"]["message"], resp.text
    assert not dirs["marker"].exists(), "the server imported a module named by a request"
    status = call(server, "GET", "/hicache_storage_backend", ADMIN).json()
    assert status["hicache_storage_backend"] is None


def test_attach_outside_the_storage_roots_is_refused_and_creates_nothing(server, dirs):
    target = dirs["outside"] / "l3"
    resp = attach(server, {**BACKEND, "storage_dir": str(target)})
    assert resp.status_code == 403 and "outside the storage roots" in resp.json()["error"]["message"], resp.text
    assert not target.exists()
    link = dirs["roots"] / "escape"
    link.symlink_to(dirs["outside"], target_is_directory=True)
    resp = attach(server, {**BACKEND, "storage_dir": str(link / "l3")})
    assert resp.status_code == 403, resp.text
    assert not (dirs["outside"] / "l3").exists()
    resp = attach(server, {**BACKEND, "storage_dirs": [str(dirs["roots"] / "ok"), "/"]})
    assert resp.status_code == 403 and "storage_dirs" in resp.json()["error"]["message"], resp.text


def test_a_failed_attach_does_not_quote_credentials(server, dirs):
    resp = attach(server, {**BACKEND, **CREDENTIALS, "fail": True, "storage_dir": str(dirs["roots"] / "fail")})
    assert resp.status_code == 400 and "cannot reach the object store" in resp.text, resp.text
    assert_no_secret(resp.text)
    assert "***" in resp.text


def test_attach_inside_the_roots_serves_and_reports_redacted(server, dirs):
    resp = attach(server, {**BACKEND, **CREDENTIALS, "storage_dir": str(dirs["roots"] / "l3")})
    assert resp.status_code == 200, resp.text
    status = call(server, "GET", "/hicache/storage-backend", ADMIN)
    assert status.json()["hicache_storage_backend"] == "dynamic"
    assert_no_secret(status.text)
    assert call(server, "POST", "/flush_cache", ADMIN).status_code == 200
    assert call(server, "POST", "/generate", API, GENERATE).status_code == 200


def test_the_log_holds_no_secret(server):
    assert call(server, "GET", "/health").status_code == 200
    with open(server.log_path, errors="replace") as f:
        assert_no_secret(f.read())
