"""SGLangClient on the wire, against a recording HTTP server on loopback: method, path, the Bearer
key, the JSON body and its Content-Type (FastAPI reads a JSON body only with it), timeouts per call
and per client, plain-text and empty answers, error statuses and a dead server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError, ServerUnavailable

pytestmark = pytest.mark.timeout(60)


class _Recorder(BaseHTTPRequestHandler):
    """Answers by path: /slow sleeps 30 s, /text is plain text, /empty has no body, /latin1 is not
    UTF-8, /fail is a 503 with a long body; anything else echoes what it received as JSON."""

    seen: list[dict] = []

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else None
        record = {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
                  "type": self.headers.get("Content-Type"), "body": body}
        self.seen.append(record)
        if self.path == "/slow":
            time.sleep(30.0)
        status, payload = 200, json.dumps(record).encode()
        if self.path == "/text":
            payload = b"Cache flushed.\nPlease check backend logs for more details."
        elif self.path == "/empty":
            payload = b""
        elif self.path == "/latin1":
            payload = "d\u00e9j\u00e0 vu".encode("latin-1")  # not UTF-8
        elif self.path == "/fail":
            status, payload = 503, ("E" * 600).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    httpd.daemon_threads, httpd.block_on_close = True, False  # teardown does not wait out /slow
    _Recorder.seen = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_post_carries_the_key_and_a_json_body(server):
    client = SGLangClient(server + "/", "sk-1")  # a trailing slash is dropped
    assert client.url == server
    echoed = client.post("/generate", {"text": "hi", "n": 2})
    assert echoed == {"method": "POST", "path": "/generate", "auth": "Bearer sk-1", "type": "application/json",
                      "body": json.dumps({"text": "hi", "n": 2})}
    assert client.post("/flush_cache")["body"] == "{}"  # no body: an empty JSON object


def test_a_get_has_no_body_and_plain_text_or_nothing_comes_back_as_such(server):
    client = SGLangClient(server, "sk-2")
    assert client.get("/model_info") == {"method": "GET", "path": "/model_info", "auth": "Bearer sk-2",
                                         "type": None, "body": None}
    assert client.get("/text") == "Cache flushed.\nPlease check backend logs for more details."
    assert client.post("/empty") is None
    assert client.get("/latin1") == "d\ufffdj\ufffd vu"  # undecodable bytes replaced, never an exception
    assert client.healthy("/health") is True


def test_an_error_status_keeps_its_body_and_names_the_url(server):
    client = SGLangClient(server, "k")
    with pytest.raises(SGLangHTTPError) as err:
        client.post("/fail", {})
    assert err.value.status == 503 and err.value.body == "E" * 600
    assert str(err.value) == f"{server}/fail: HTTP 503: " + "E" * 500  # the message keeps 500 characters
    assert client.healthy("/fail") is False


@pytest.mark.parametrize("call", ["get", "post"])
def test_a_per_call_timeout_wins_over_the_clients(server, call):
    client = SGLangClient(server, "k", timeout_s=30.0)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"/slow"):
        getattr(client, call)("/slow", timeout_s=0.3)
    assert time.monotonic() - start < 10.0  # 0.3 s, not the reply's 30 s (a loaded host stalls for seconds)


def test_the_clients_timeout_applies_when_a_call_sets_none(server):
    client = SGLangClient(server, "k", timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable):
        client.post("/slow", {})
    assert time.monotonic() - start < 10.0  # 0.3 s, not the reply's 30 s (a loaded host stalls for seconds)
    assert client.healthy("/slow", timeout_s=0.3) is False
    assert SGLangClient(server, "k").timeout_s == 3600.0  # a 16K-token generate may take minutes


def test_a_dead_server_is_unavailable_not_an_http_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        client = SGLangClient(f"http://127.0.0.1:{port}", "k")
        with pytest.raises(ServerUnavailable, match=f"127.0.0.1:{port}/health"):
            client.get("/health")
        assert client.healthy() is False


def test_only_trailing_slashes_are_cut_from_the_url():
    assert SGLangClient("http://node-X:30000//", "k").url == "http://node-X:30000"
    assert SGLangClient("http://gpu-node-X", "k").url == "http://gpu-node-X"  # a host name that ends in X
