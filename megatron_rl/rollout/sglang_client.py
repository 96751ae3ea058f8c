"""HTTP client of one SGLang server: JSON over stdlib urllib, API key as a Bearer token."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any


class ServerUnavailable(RuntimeError):
    """The server did not answer (refused, reset, timed out): it may be dead."""


class SGLangHTTPError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class SGLangClient:
    """Requests to one server (or router). Every request carries `Authorization: Bearer <key>`.

    Args:
        url: "http://host:port" of the server.
        api_key: the server's --api-key; SGLang refuses weight-update endpoints without it (401).
        timeout_s: per-request timeout; a generate of 16K tokens can take minutes.
    """

    def __init__(self, url: str, api_key: str, timeout_s: float = 3600.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        data = json.dumps(body if body is not None else {}).encode()
        return self._request("POST", path, data, timeout_s)

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return self._request("GET", path, None, timeout_s)

    def healthy(self, path: str = "/health", timeout_s: float = 5.0) -> bool:
        """True when `path` answers 200 (/health: process up; /health_generate: it can generate)."""
        try:
            self._request("GET", path, None, timeout_s)
            return True
        except (ServerUnavailable, SGLangHTTPError):
            return False

    def _request(self, method: str, path: str, data: bytes | None, timeout_s: float | None) -> Any:
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.api_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise SGLangHTTPError(self.url + path, e.code, e.read().decode(errors="replace")) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout,
                TimeoutError) as e:
            raise ServerUnavailable(f"{self.url}{path}: {e}") from None
        return _decode(raw)


def _decode(raw: bytes) -> Any:
    """SGLang answers JSON for most endpoints and plain text for a few (flush_cache)."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
