"""Hostile requests to the hidden-state producer (issue 27): every malformed request gets a 4xx with a JSON
reason, integer fields refuse floats and bools (``{"layer": 1.7}`` was served as layer 1), and a deeply
nested body is refused before it is parsed (it killed the handler thread: the client got an empty reply).
The server is the in-process one of ``test_service.py`` on a free 127.0.0.1 port, stopped by its fixture."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from test_service import TOKEN, body, service  # noqa: F401  (module fixture)

DEEP = 100_000


def exchange(url: str, raw: bytes) -> tuple[int, dict]:
    """Send ``raw`` bytes as one request and read the reply (an empty reply raises)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        response = http.client.HTTPResponse(s)
        response.begin()
        assert response.getheader("Content-Type") == "application/json"
        return response.status, json.loads(response.read())


def request(data: bytes, *, length: str | None = "auto", method: str = "POST", path: str = "/extract") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {TOKEN}", "Connection: close"]
    if length is not None:
        head.append(f"Content-Length: {len(data) if length == 'auto' else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def with_slot(**slot) -> bytes:
    return json.dumps({**body("a", [1, 2]), "slots": [slot]}).encode()


@pytest.mark.parametrize(
    "raw, status, message",
    [
        (request(with_slot(layer=1.7, side="output")), 400, "slots[0].layer must be an integer, got a number 1.7"),
        (request(with_slot(layer=True, side="output")), 400, "slots[0].layer must be an integer, got a boolean true"),
        (request(with_slot(layer="1", side="output")), 400, 'slots[0].layer must be an integer, got a string "1"'),
        (request(with_slot(layer=1, side="middle")), 400, "slots[0].side must be one of 'input', 'output'"),
        (request(json.dumps(body("a", [1, 2.0])).encode()), 400, "token_ids[1] must be an integer, got a number 2.0"),
        (request(json.dumps(body("a", [1, False])).encode()), 400, "token_ids[1] must be an integer, got a boolean false"),
        (request(json.dumps(body("a", [1], target_fingerprint=7)).encode()), 400, "target_fingerprint must be a string"),
        (request(json.dumps({**body("a", [1]), "key": ["a"]}).encode()), 400, "key must be a string, got an array"),
        (request(b"[" * DEEP + b"]" * DEEP), 400, "deeper than 16 levels"),
        (request(b'{"key": "a", "token_ids": ' + b"[" * DEEP + b"]" * DEEP + b"}"), 400, "deeper than 16 levels"),
        (request(b'{"key": "[[[[[[[[[[[[[[[[[[[[", "token_ids": [1], "slots": [{"layer": 1, "side": "output"}]}'), 200, ""),
        (request(b'{"key": "a", "token_ids": [NaN], "slots": []}'), 400, "holds NaN, which is not JSON"),
        (request(b'{"key": "a", "key": "b", "token_ids": [1], "slots": []}'), 400, "repeats the field 'key'"),
        (request(b'{"key": "a", "token_ids": [' + b"9" * 5000 + b'], "slots": []}'), 400, "not valid JSON"),
        (request(b"\xff\xfe{}"), 400, "not valid JSON"),
        (request(b"", length=None), 411, "Content-Length"),
        (request(b"", length="-2"), 411, "Content-Length"),
        (request(b"", length="\u00b2".encode().decode("latin-1")), 411, "Content-Length"),
        (request(b"", length=str(10**9)), 413, "exceeds this server's limit"),
        (request(b"{}", method="PUT"), 405, "PUT"),
        (b"NONSENSE\r\n\r\n", 400, "request"),
    ],
)
def test_malformed_requests_get_a_4xx_with_a_json_reason(service, raw, status, message):
    got, reply = exchange(service.url, raw)
    assert got == status, reply
    assert message in (reply.get("error", "") if status != 200 else "")
    assert service.health()["status"] == "ok"  # the server still answers


def test_a_body_that_never_arrives_times_out_with_408(service, monkeypatch):
    monkeypatch.setattr(service._server.RequestHandlerClass, "timeout", 0.5)
    status, reply = exchange(service.url, request(b'{"key": ', length="100"))
    assert status == 408 and "did not arrive in time" in reply["error"]
