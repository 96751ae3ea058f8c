"""A remote reward: batches POSTed as JSON to an HTTP endpoint, with a timeout and retries.

Request body: {"responses": [str], "answers": [str], "extra": [{column: value}]} (one entry per
sample, in order; the loop's extra holds the row's other columns and "prompt", the prompt text). Reply: {"rewards": [float | {"score": float, ...}]} or the bare list, the same
length. Connection errors, timeouts, HTTP 429 and 5xx are retried `max_retries` times with
exponential backoff; any other failure (4xx, a malformed reply) raises at once. The RewardRunner
turns a raise into reward 0 for the batch, counted, as it does for a local reward.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)

RETRIED_STATUS = (429, 500, 502, 503, 504)


class RewardServerError(RuntimeError):
    """The endpoint failed (after retries, or with an error that is not retried)."""


class HttpReward:
    """Batched reward callable over HTTP: `reward(responses, answers, **extra) -> list`.

    `timeout_s` bounds each attempt (connect and every read); the whole call is bounded by
    `max_budget_s()` = attempts x timeout plus the backoff sleeps.
    """

    batched = True

    def __init__(self, url: str, timeout_s: float = 10.0, max_retries: int = 3, backoff_s: float = 1.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward url {url!r}: expected http:// or https://")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self.__name__ = f"http:{url}"

    def max_budget_s(self) -> float:
        backoff = sum(self.backoff_s * 2**k for k in range(self.max_retries))
        return (self.max_retries + 1) * self.timeout_s + backoff

    def __call__(self, responses: list[str], answers: list[str], **extra: list[Any]) -> list[Any]:
        rows = [{k: v[i] for k, v in extra.items()} for i in range(len(responses))]
        body = json.dumps({"responses": list(responses), "answers": list(answers), "extra": rows}).encode()
        reply = self._post(body)
        rewards = reply.get("rewards") if isinstance(reply, dict) else reply
        if not isinstance(rewards, list) or len(rewards) != len(responses):
            raise RewardServerError(f"{self.url}: expected {len(responses)} rewards, got {str(reply)[:200]}")
        return rewards

    def _post(self, body: bytes) -> Any:
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._attempt(body)
            except _Retryable as err:
                last = str(err)
                logger.warning("reward server %s, attempt %d/%d: %s", self.url, attempt + 1, self.max_retries + 1, last)
        raise RewardServerError(f"{self.url}: failed after {self.max_retries + 1} attempts: {last}")

    def _attempt(self, body: bytes) -> Any:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                payload = reply.read()
        except urllib.error.HTTPError as err:
            if err.code in RETRIED_STATUS:
                raise _Retryable(f"HTTP {err.code}") from None
            raise RewardServerError(f"{self.url}: HTTP {err.code}: {err.read()[:200]!r}") from None
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as err:
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        try:
            return json.loads(payload)
        except json.JSONDecodeError as err:
            raise RewardServerError(f"{self.url}: reply is not JSON: {err}") from None


class _Retryable(Exception):
    pass
