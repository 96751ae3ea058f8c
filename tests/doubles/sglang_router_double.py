"""A behavioural double of sglang-router (the SGLang model gateway): loopback HTTP proxy (tests only).

Launch it the way the project launches `python -m sglang_router.launch_router` (unknown flags are
accepted and ignored)::

    python tests/doubles/sglang_router_double.py --worker-urls http://127.0.0.1:30000 ... \
        --host 127.0.0.1 --port 30999 [--api-key KEY] [--request-timeout-secs 1800] [--policy ...]

or point `rollout.sglang.router_command` at `[python, tests/doubles/sglang_router_double.py]`.

Behaviours (sgl-router / sgl-model-gateway, RouterArgs in sglang_router/router_args.py):
- `--api-key` is the gateway-to-worker key: every forwarded request carries `Authorization: Bearer
  KEY`; without it, workers started with --api-key answer 401, which the router passes back.
- `--request-timeout-secs` (default 1800) bounds one forwarded request; past it the router answers
  504 although the worker may still be generating (a 16K-token rollout can take longer).
- /generate goes to the worker with the fewest requests in flight (ties: round robin); /health
  answers 200 while the router runs; /workers lists the worker URLs. Other paths are not proxied.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from double_http import QuietHandler, serve  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker-urls", nargs="+", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--request-timeout-secs", type=float, default=1800.0)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--lifetime-s", type=float, default=600.0)
    args, ignored = ap.parse_known_args(argv)
    args.ignored = ignored
    return args


class Router:
    def __init__(self, args):
        self.args = args
        self.in_flight = {u.rstrip("/"): 0 for u in args.worker_urls}
        self.turn = itertools.count()
        self.lock = threading.Lock()

    def pick(self) -> str:
        with self.lock:
            least = min(self.in_flight.values())
            tied = [u for u, n in self.in_flight.items() if n == least]
            url = tied[next(self.turn) % len(tied)]
            self.in_flight[url] += 1
            return url

    def forward(self, path: str, data: bytes) -> tuple[int, bytes]:
        url = self.pick()
        req = urllib.request.Request(url + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        if self.args.api_key:
            req.add_header("Authorization", f"Bearer {self.args.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.args.request_timeout_secs) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except (socket.timeout, TimeoutError):
            return 504, json.dumps({"error": f"request to {url} timed out after "
                                             f"{self.args.request_timeout_secs} s"}).encode()
        except (urllib.error.URLError, ConnectionError) as err:
            return 502, json.dumps({"error": f"worker {url} unreachable: {err}"}).encode()
        finally:
            with self.lock:
                self.in_flight[url] -= 1


def make_handler(router: Router):
    class Handler(QuietHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/health", "/readiness", "/liveness"):
                return self.reply(200, b"")
            if path == "/workers":
                return self.reply(200, {"urls": list(router.in_flight)})
            self.reply(404, {"error": "not found"})

        def do_POST(self):
            data = self.body()
            if self.path.split("?")[0] != "/generate":
                return self.reply(404, {"error": "the router double proxies /generate only"})
            self.reply(*router.forward("/generate", data))

    return Handler


def main(argv=None) -> None:
    args = parse_args(argv)
    serve(make_handler(Router(args)), args.host, args.port, args.lifetime_s,
          f"sglang router double on {args.host}:{args.port} -> {args.worker_urls}")

if __name__ == "__main__":
    main()
