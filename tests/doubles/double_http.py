"""HTTP plumbing shared by the SGLang doubles: a quiet HTTP/1.1 handler, replies, a timed server."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def reply(self, status: int, payload) -> None:
        """str -> text/plain (as SGLang's /flush_cache), bytes -> JSON as is, else JSON-encoded."""
        text = isinstance(payload, str)
        data = payload if isinstance(payload, bytes) else payload.encode() if text else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(handler_cls, host: str, port: int, lifetime_s: float, banner: str) -> None:
    """Serve until `lifetime_s` has passed, then exit the process (a test never leaks a double)."""
    server = ThreadingHTTPServer((host, port), handler_cls)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(banner, flush=True)
    time.sleep(lifetime_s)
    os._exit(0)
