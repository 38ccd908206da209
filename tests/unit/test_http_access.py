"""Who may call the HTTP door (``tessera.cluster.http_access``): the key on every route
but ``/health`` (``/metrics`` opened by ``metrics_open``), the ``Host`` a keyless local
server answers to, and JSON bodies only."""

from __future__ import annotations

import pytest
from fastapi import Request

from tessera.cluster.http_access import HttpAccess, is_json, is_loopback
from tessera.cluster.openai_errors import APIError
from tessera.cluster.serve_config import ServeConfig


def _request(**headers: str) -> Request:
    raw = [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


def _access(monkeypatch, **settings) -> HttpAccess:
    monkeypatch.delenv("TESSERA_API_KEY", raising=False)
    return HttpAccess(ServeConfig.create(port=8000, **settings))


def _status(call) -> int | None:
    try:
        call()
    except APIError as error:
        return error.status
    return None


def test_a_keyless_local_server_answers_only_to_local_names(monkeypatch):
    access = _access(monkeypatch)
    # any port: behind `serve run` or a proxy the app does not know the one it is reached on
    local = ("localhost", "localhost:8000", "127.0.0.1:58535", "[::1]:8000", "[::1]", "LOCALHOST")
    for host in local:
        access.authorize(_request(host=host))
    access.authorize(_request())  # no Host at all: no browser sends that
    refused = ("attacker.example:8000", "localhost:x", "127.0.0.1.nip.io:8000", "localhost.", "::1")
    for host in refused:
        with pytest.raises(APIError) as caught:
            access.authorize(_request(host=host))
        error = caught.value
        assert (error.status, error.param, error.code) == (403, "Host", "invalid_host")
        assert error.message.startswith(f"Host: {host!r} is not a name of this server")
    assert _status(lambda: access.check_host(_request(host="evil.example"))) == 403  # /health


def test_a_server_with_a_key_or_beyond_loopback_takes_any_host(monkeypatch):
    for settings in ({"api_key": "k"}, {"host": "0.0.0.0"}, {"host": "10.1.2.3"}):
        access = _access(monkeypatch, **settings)
        access.check_host(_request(host="tessera.example.com"))
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_the_key_guards_every_route_and_metrics_unless_opened(monkeypatch):
    access = _access(monkeypatch, api_key="s3cret")
    good = _request(authorization="Bearer s3cret")
    assert _status(lambda: access.authorize(good)) is None
    assert _status(lambda: access.authorize(_request())) == 401
    assert _status(lambda: access.authorize(_request(authorization="Bearer nope"))) == 401
    assert _status(lambda: access.authorize_metrics(_request())) == 401
    opened = _access(monkeypatch, api_key="s3cret", metrics_open=True)
    assert _status(lambda: opened.authorize_metrics(_request())) is None
    assert _status(lambda: opened.authorize(_request())) == 401  # /docs, /openapi.json


def test_only_json_bodies_are_read():
    HttpAccess.check_json(_request())  # no Content-Type: read as JSON
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        HttpAccess.check_json(_request(content_type=content_type))
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "text/plain; application/json",
    ):
        with pytest.raises(APIError) as caught:
            HttpAccess.check_json(_request(content_type=content_type))
        error = caught.value
        assert (error.status, error.param) == (415, "Content-Type")
        assert error.message == (
            f"Content-Type: the body must be JSON (application/json), got {content_type!r}"
        )
    assert is_json("application/merge-patch+json") and not is_json("text/json+x")
