"""sglang-router's /generate as the gateway parses and routes it (test helper of the router double).

Transcribed from sgl-model-gateway (the Rust gateway in the sglang repository):
- server.rs `async fn generate(..., Json(body): Json<GenerateRequest>)`: axum's `Json` extractor
  deserializes the body into the typed struct before any routing; a body that does not fit the
  type is refused with 422 Unprocessable Entity ("Failed to deserialize the JSON body into the
  target type: ..."), a body that is not JSON with 400, a missing JSON content type with 415.
- src/protocols/generate.rs `pub struct GenerateRequest`: `sampling_params: Option<SamplingParams>`
  (one struct, never a list), `input_ids: Option<InputIds>` (common.rs: untagged `Single(Vec<i32>)`
  or `Batch(Vec<Vec<i32>>)`), `text: Option<String>`, `return_logprob: Option<bool>`,
  `logprob_start_len: Option<i32>`, the `#[serde(default)]` booleans; serde ignores unknown fields.
- src/protocols/sampling_params.rs `pub struct SamplingParams`: the typed fields below.
- The router forwards the typed request re-serialized (`.json(typed_req)`): fields it does not
  define are dropped; Option fields are `skip_serializing_if = "Option::is_none"`.
- src/policies/cache_aware.rs (default policy, thresholds of main.rs `parse_policy_config`:
  cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5): when
  (max_load - min_load) > 64 and max_load > 1.5 x min_load, the worker with the least load; else
  the worker whose approximate radix tree (of request texts: input_ids joined with spaces,
  generate.rs `extract_text_for_routing`) matches the longest prefix if the match rate is over
  0.3, otherwise the worker with the smallest tree. round_robin.rs: the next worker in turn.
"""

from __future__ import annotations

import itertools
import json
import threading

U32, I32, U64 = (0, 2**32 - 1), (-2**31, 2**31 - 1), (0, 2**64 - 1)


class Unprocessable(ValueError):
    """The body does not deserialize into GenerateRequest: 422."""


def _int(range_):
    def check(v):
        return isinstance(v, int) and not isinstance(v, bool) and range_[0] <= v <= range_[1]
    return check


def _is(*types):
    return lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


_float, _str, _bool = _is(int, float), _is(str), _is(bool)
_any = lambda v: True  # noqa: E731  (serde_json::Value)
SAMPLING_PARAMS = {  # sampling_params.rs: every field Option<...>
    "temperature": _float, "max_new_tokens": _int(U32), "top_p": _float, "top_k": _int(I32),
    "frequency_penalty": _float, "presence_penalty": _float, "repetition_penalty": _float,
    "stop": lambda v: _str(v) or _list_of(_str)(v), "ignore_eos": _bool, "skip_special_tokens": _bool,
    "json_schema": _str, "regex": _str, "ebnf": _str, "min_p": _float, "min_new_tokens": _int(U32),
    "stop_token_ids": _list_of(_int(U32)), "no_stop_trim": _bool, "n": _int(U32), "sampling_seed": _int(U64),
}
_input_ids = lambda v: _list_of(_int(I32))(v) or _list_of(_list_of(_int(I32)))(v)  # noqa: E731
GENERATE_OPTIONAL = {  # generate.rs: Option<...> fields (skipped when None)
    "text": _str, "model": _str, "input_ids": _input_ids, "input_embeds": _any, "image_data": _any,
    "video_data": _any, "audio_data": _any, "sampling_params": None, "return_logprob": _bool,
    "logprob_start_len": _int(I32), "top_logprobs_num": _int(I32), "token_ids_logprob": _list_of(_int(U32)),
    "modalities": _list_of(_str), "session_params": _is(dict), "lora_path": _str, "lora_id": _str,
    "custom_logit_processor": _str, "bootstrap_host": _str, "bootstrap_port": _int(I32),
    "bootstrap_room": _int(I32), "bootstrap_pair_key": _str, "data_parallel_rank": _int(I32),
    "conversation_id": _str, "priority": _int(I32), "extra_key": _str, "custom_labels": _is(dict), "rid": _str,
}
GENERATE_DEFAULTS = {  # generate.rs: #[serde(default)] fields, always serialized
    "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "background": False, "no_logs": False, "return_bytes": False,
    "return_entropy": False,
}


def _fail(path: str, value) -> None:
    kind = type(value).__name__.replace("list", "sequence").replace("dict", "map")
    raise Unprocessable(f"Failed to deserialize the JSON body into the target type: {path}: invalid type: "
                        f"{kind}, expected the type sgl-model-gateway declares")


def parse_sampling_params(value) -> dict:
    if not isinstance(value, dict):
        _fail("sampling_params", value)  # a list: "invalid type: sequence, expected struct SamplingParams"
    out = {}
    for key, v in value.items():
        if key in SAMPLING_PARAMS and v is not None:
            if not SAMPLING_PARAMS[key](v):
                _fail(f"sampling_params.{key}", v)
            out[key] = v
    return out


def parse_generate(body: dict) -> dict:
    """The body the router forwards: GenerateRequest deserialized and serialized again.
    Raises Unprocessable (422) where serde would fail."""
    if not isinstance(body, dict):
        _fail("GenerateRequest", body)
    out = {}
    for key, check in GENERATE_OPTIONAL.items():
        v = body.get(key)
        if v is None:
            continue
        if key == "sampling_params":
            out[key] = parse_sampling_params(v)
        elif not check(v):
            _fail(key, v)
        else:
            out[key] = v
    for key, default in GENERATE_DEFAULTS.items():
        v = body.get(key, default)
        if not _bool(v):
            _fail(key, v)
        out[key] = v
    # `model` is serialized as null by the gateway (no skip_serializing_if); SGLang's GenerateReqInput
    # has no `model` field and the server double refuses unknown fields, so it is not forwarded.
    out.pop("model", None)
    return out


def routing_text(body: dict) -> str:
    """generate.rs extract_text_for_routing: text, else every input id joined with spaces."""
    if body.get("text") is not None:
        return body["text"]
    ids = body.get("input_ids") or []
    flat = [t for row in ids for t in row] if ids and isinstance(ids[0], list) else ids
    return " ".join(str(t) for t in flat)


class CacheAware:
    """cache_aware.rs select_worker over an exact radix tree per worker (a set of its prefixes)."""

    def __init__(self, urls: list[str], cache_threshold=0.3, abs_threshold=64, rel_threshold=1.5):
        self.urls, self.prefixes = list(urls), {u: {""} for u in urls}
        self.cache_threshold, self.abs_threshold, self.rel_threshold = cache_threshold, abs_threshold, rel_threshold

    def select(self, text: str, load: dict[str, int]) -> str:
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            url = min(self.urls, key=lambda u: load[u])
        else:
            matched = {u: self._match(u, text) for u in self.urls}
            best = max(self.urls, key=lambda u: matched[u])
            rate = matched[best] / len(text) if text else 0.0
            url = best if rate > self.cache_threshold else min(self.urls, key=lambda u: len(self.prefixes[u]))
        self.prefixes[url].update(text[:i] for i in range(len(text) + 1))
        return url

    def _match(self, url: str, text: str) -> int:
        held = self.prefixes[url]
        return max(i for i in range(len(text) + 1) if text[:i] in held)


class RoundRobin:
    def __init__(self, urls: list[str]):
        self.urls, self.turn = list(urls), itertools.count()

    def select(self, text: str, load: dict[str, int]) -> str:
        return self.urls[next(self.turn) % len(self.urls)]


POLICIES = {"cache_aware": CacheAware, "round_robin": RoundRobin}


class Balancer:
    """A policy plus the per-worker load the gateway counts (incremented when a request is routed,
    decremented when it completes), safe across the double's request threads."""

    def __init__(self, policy: str, urls: list[str]):
        if policy not in POLICIES:
            raise SystemExit(f"router double: policy {policy!r} is not modelled ({sorted(POLICIES)})")
        self.policy, self.load = POLICIES[policy](urls), {u: 0 for u in urls}
        self.routed = {u: 0 for u in urls}
        self.lock = threading.Lock()

    def acquire(self, body: dict) -> str:
        with self.lock:
            url = self.policy.select(routing_text(body), self.load)
            self.load[url] += 1
            self.routed[url] += 1
            return url

    def release(self, url: str) -> None:
        with self.lock:
            self.load[url] -= 1


def decode(data: bytes, content_type: str | None):
    """(status, body or message) as axum's Json extractor: 415 without a JSON content type,
    400 for a syntax error."""
    if not (content_type or "").startswith("application/json"):
        return 415, "Expected request with `Content-Type: application/json`"
    try:
        return 200, json.loads(data or b"null")
    except ValueError as err:
        return 400, f"Failed to parse the request body as JSON: {err}"
