"""A behavioural double of sglang-router (the SGLang model gateway): loopback HTTP proxy (tests only).

Launch it the way the project launches `python -m sglang_router.launch_router` (unknown flags are
accepted and ignored)::

    python tests/doubles/sglang_router_double.py --worker-urls http://127.0.0.1:30000 ... \
        --host 127.0.0.1 --port 30999 [--api-key KEY] [--request-timeout-secs 1800] [--policy ...]

or point `rollout.sglang.router_command` at `[python, tests/doubles/sglang_router_double.py]`.

Behaviours (sgl-router / sgl-model-gateway, RouterArgs in sglang_router/router_args.py):
- `--api-key` is the gateway-to-worker key: every forwarded request carries `Authorization: Bearer
  KEY`; without it, workers started with --api-key answer 401, which the router passes back. The
  same key guards the gateway's own routes: /generate and /workers without `Authorization: Bearer
  KEY` are answered 401 before any worker sees them, while /health, /readiness and /liveness stay
  open (sgl-model-gateway src/server.rs `build_app`: protected, worker and public routes;
  src/middleware.rs `auth_middleware`).
- `--request-timeout-secs` (default 1800) bounds one forwarded request; past it the router answers
  504 although the worker may still be generating (a 16K-token rollout can take longer).
- /generate is parsed as the gateway's typed GenerateRequest and forwarded re-serialized (fields it
  does not define dropped); a body that does not fit (a list of sampling_params) is answered 422
  before any worker sees it; routing follows --policy (cache_aware, the default, or round_robin):
  router_protocol.py transcribes both, with their source files.
- /health answers 200 while the router runs; /workers lists the worker URLs. Other paths are not
  proxied. GET /double/routed (the double's own) answers how many requests went to each worker.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from double_http import QuietHandler, serve  # noqa: E402
from router_protocol import Balancer, Unprocessable, decode, parse_generate  # noqa: E402


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
        self.balancer = Balancer(args.policy, [u.rstrip("/") for u in args.worker_urls])

    def forward(self, path: str, body: dict) -> tuple[int, bytes]:
        url = self.balancer.acquire(body)
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
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
            self.balancer.release(url)


def make_handler(router: Router):
    class Handler(QuietHandler):
        def authorized(self) -> bool:
            key = router.args.api_key
            if not key or self.headers.get("Authorization") == f"Bearer {key}":
                return True
            self.reply(401, b"")  # auth_middleware answers a bare StatusCode::UNAUTHORIZED
            return False

        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/health", "/readiness", "/liveness"):
                return self.reply(200, b"")
            if path == "/workers":
                if self.authorized():
                    self.reply(200, {"urls": list(router.balancer.load)})
                return
            if path == "/double/routed":
                return self.reply(200, dict(router.balancer.routed))
            self.reply(404, {"error": "not found"})

        def do_POST(self):
            data = self.body()
            if self.path.split("?")[0] != "/generate":
                return self.reply(404, {"error": "the router double proxies /generate only"})
            if not self.authorized():
                return
            status, body = decode(data, self.headers.get("Content-Type"))
            if status != 200:
                return self.reply(status, body)
            try:
                typed = parse_generate(body)
            except Unprocessable as err:
                return self.reply(422, str(err))
            self.reply(*router.forward("/generate", typed))

    return Handler


def main(argv=None) -> None:
    args = parse_args(argv)
    serve(make_handler(Router(args)), args.host, args.port, args.lifetime_s,
          f"sglang router double on {args.host}:{args.port} -> {args.worker_urls}")

if __name__ == "__main__":
    main()
