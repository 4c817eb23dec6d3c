"""The security helpers without a server: the auth decision table (upstream's rules, stricter for
ADMIN_FORCE), secret redaction, per-user private directories, the attach policy (dynamic backend
and storage roots) and the JSON body checks."""

import json
import os
import stat
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.http_common import parse_json_body
from sglang.srt.managers.generate_request import BadRequestError
from sglang.srt.managers.storage_admin import AdminRefusal, check_attach_allowed, storage_roots
from sglang.srt.utils.auth import AuthLevel, decide_request_auth
from sglang.srt.utils.private_dir import ensure_private_dir, user_private_dir
from sglang.srt.utils.redact import redact_config, redact_config_json, redact_text
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

A, M = "api-key", "admin-key"
N, O, F = AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE


def decide(level, header, api_key=None, admin_api_key=None, path="/x", method="POST"):
    d = decide_request_auth(method=method, path=path, authorization_header=header, api_key=api_key,
                            admin_api_key=admin_api_key, auth_level=level)
    return 200 if d.allowed else d.error_status_code


@pytest.mark.parametrize("level, keys, header, expected", [
    # no key configured: ordinary and admin-optional routes open, admin-force routes never
    (N, (None, None), None, 200), (O, (None, None), None, 200), (F, (None, None), f"Bearer {A}", 403),
    # api key only: every route but admin-force needs it
    (N, (A, None), None, 401), (N, (A, None), f"Bearer {A}", 200), (O, (A, None), f"Bearer {A}", 200),
    (F, (A, None), f"Bearer {A}", 403),
    # admin key only: ordinary routes open, admin routes need it
    (N, (None, M), None, 200), (O, (None, M), None, 401), (F, (None, M), f"Bearer {M}", 200),
    (F, (None, M), None, 401),
    # both: each route its own key; the api key never opens an admin route
    (N, (A, M), f"Bearer {M}", 401), (N, (A, M), f"bearer {A}", 200), (O, (A, M), f"Bearer {A}", 401),
    (F, (A, M), f"Bearer {A}", 401), (F, (A, M), f"Bearer {M}", 200), (F, (A, M), M, 401),
    (F, (A, M), f"Basic {M}", 401), (F, (A, M), f"Bearer {M}x", 401),
])
def test_auth_table(level, keys, header, expected):
    assert decide(level, header, *keys) == expected


def test_probes_and_preflight_are_open_and_odd_headers_do_not_raise():
    assert decide(N, None, A, M, path="/health") == 200
    assert decide(N, None, A, M, path="/metrics") == 200
    assert decide(F, None, A, M, method="OPTIONS") == 200
    assert decide(N, "Bearer \xe9\xff", A, M) == 401  # latin-1 header bytes: compared, not raised
    assert decide(N, "Bearer", A, M) == 401


def test_refusal_messages_hold_no_key():
    d = decide_request_auth(method="POST", path="/flush_cache", authorization_header="Bearer sent-Q7", api_key="api-Z9",
                            admin_api_key="admin-X3", auth_level=F)
    assert d.error_status_code == 401 and "--admin-api-key" in d.message
    assert not any(k in d.message for k in ("sent-Q7", "api-Z9", "admin-X3"))


def test_redact_config_by_key_name_at_any_depth():
    config = {"storage_dir": "/d", "access_key": "AK", "secret_key": "SK", "prefetch_threshold": 4,
              "plugin_params": {"AWS_SESSION_TOKEN": "T", "endpoint": "https://u:pw@h:1/b", "use_https": True},
              "list": [{"password": 7}], "hicache_storage_pass_prefix_keys": False, "api_key": None}
    assert redact_config(config) == {
        "storage_dir": "/d", "access_key": "***", "secret_key": "***", "prefetch_threshold": 4,
        "plugin_params": {"AWS_SESSION_TOKEN": "***", "endpoint": "https://***@h:1/b", "use_https": True},
        "list": [{"password": "***"}], "hicache_storage_pass_prefix_keys": False, "api_key": None}
    assert json.loads(redact_config_json(json.dumps(config)))["secret_key"] == "***"
    assert redact_config_json("@/etc/l3.toml") == "@/etc/l3.toml" and redact_config_json(None) is None
    assert redact_config_json("{not json") == "***"


def test_redact_text_replaces_every_secret_value():
    config = {"access_key": "AKIA1234", "nested": {"secret": "s3cr3t-value"}, "url": "s3://me:hunter22@x",
              "token": "ab"}
    text = "failed with {'access_key': 'AKIA1234', 'secret': 's3cr3t-value', 'url': 's3://me:hunter22@x'} ab"
    out = redact_text(text, json.dumps(config))
    for secret in ("AKIA1234", "s3cr3t-value", "hunter22"):
        assert secret not in out
    assert out.endswith(" ab")  # shorter than 4 characters: not looked for


def test_private_dir_is_created_0700_and_tightened(tmp_path):
    path = user_private_dir("hicache", base=str(tmp_path))
    assert path == str(tmp_path / f"hicache-{os.geteuid()}")
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    os.chmod(path, 0o777)
    ensure_private_dir(path)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_private_dir_refuses_symlinks_files_and_foreign_owners(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"hicache-{os.geteuid()}"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(PermissionError, match="symlink"):
        user_private_dir("hicache", base=str(tmp_path))
    (tmp_path / "plain").write_text("")
    with pytest.raises(PermissionError, match="not a directory"):
        ensure_private_dir(str(tmp_path / "plain"))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 12345, 12345)
    else:
        foreign = tmp_path.anchor  # "/" belongs to root
    with pytest.raises(PermissionError, match="owned by uid|open"):
        ensure_private_dir(str(foreign))


def args(backend=None, extra=None, roots=()):
    return SimpleNamespace(hicache_storage_backend=backend, storage_extra_config=extra or {}, storage_roots=roots)


def test_dynamic_only_as_started(tmp_path):
    started = args("dynamic", {"module_path": "pkg.mod", "class_name": "B", "storage_dir": str(tmp_path)})
    check_attach_allowed(started, "dynamic", {"module_path": "pkg.mod", "class_name": "B"})
    for a, extra in ((args("file"), {"module_path": "pkg.mod", "class_name": "B"}),
                     (started, {"module_path": "evil", "class_name": "B"}),
                     (started, {"module_path": "pkg.mod", "class_name": "C"})):
        with pytest.raises(AdminRefusal, match="never names a module") as info:
            check_attach_allowed(a, "dynamic", extra)
        assert info.value.status == 403


def test_directories_must_lie_inside_the_roots(tmp_path):
    root, startup, outside = tmp_path / "root", tmp_path / "startup", tmp_path / "outside"
    for d in (root, startup, outside):
        d.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    a = args("file", {"storage_dir": str(startup)}, roots=(str(root),))
    assert storage_roots(a) == (str(root), str(startup))
    for extra in ({"storage_dir": str(root / "new" / "l3")}, {"file_storage_path": str(startup)},
                  {"storage_dirs": [str(root / "a"), str(startup / "b")]},
                  {"storage_dir": f"{root}/a,{startup}/b"}, {}):
        check_attach_allowed(a, "file", extra)
    for extra in ({"storage_dir": str(outside)}, {"storage_dir": str(root / "link" / "l3")},
                  {"storage_dir": str(root) + "-sibling"}, {"storage_dirs": [str(root / "a"), "/etc"]},
                  {"storage_dir": f"{root}/a,/var/tmp"}, {"storage_dir": str(root / ".." / "outside")}):
        with pytest.raises(AdminRefusal, match="outside the storage roots"):
            check_attach_allowed(a, "file", extra)
    assert not (root / "new").exists()
    with pytest.raises(AdminRefusal, match="none configured"):
        check_attach_allowed(args(), "file", {"storage_dir": str(root)})


@pytest.mark.parametrize("body, words", [
    (b'{"a": ' + b"[" * 33 + b"]" * 33 + b"}", ["32 levels"]),
    (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", ["32 levels"]),
    (b'{"a": ' + b"7" * 4301 + b"}", ["4300 digits"]),
    (b"[1]", ["JSON object"]),
    (b"{", ["malformed"]),
])
def test_json_body_checks(body, words):
    with pytest.raises(BadRequestError) as info:
        parse_json_body(body)
    for w in words:
        assert w in str(info.value)


def test_json_body_at_the_limits_parses():
    deep = b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}"  # 32 levels with the object
    assert "a" in parse_json_body(deep)
    assert parse_json_body(b'{"ids": [' + b"1, " * 1000 + b'1], "x": [[[]]]}')["x"] == [[[]]]
