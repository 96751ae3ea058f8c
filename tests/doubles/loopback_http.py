"""A real HTTP server on 127.0.0.1 (http.server, an ephemeral port) for the HTTP reward's tests: each
POST's JSON body is recorded and handed to `respond(handler, body)`, which writes the answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackHttp:
    def __init__(self, respond):
        self.bodies: list = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                respond(self, body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads, self.httpd.block_on_close = True, False  # close does not wait out a slow reply
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def send_json(handler: BaseHTTPRequestHandler, payload: bytes) -> bool:
    """A 200 with `payload`; False when the client had already gone (it timed out)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.end_headers()
    try:
        handler.wfile.write(payload)
        return True
    except BrokenPipeError:
        return False
