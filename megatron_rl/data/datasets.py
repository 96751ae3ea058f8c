"""Prompt datasets from JSONL, Parquet or in-memory records; bad rows are skipped, logged and counted.

Keys may be dotted to reach nested columns (`reward_model.ground_truth`); answers of any JSON type
are kept as strings (JSON text for non-strings: 42 -> "42"); the row's other columns travel with
the item as `extra` (they reach user reward functions as keyword arguments).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PromptDataset", "PromptFormat", "PromptItem", "answer_text", "lookup"]

logger = logging.getLogger(__name__)

MAX_LOGGED_BAD_ROWS = 20  # per dataset; the summary line always gives the full counts by reason
# Skip reasons, as counted in PromptDataset.skip_reasons.
BAD_JSON, NOT_OBJECT, MISSING, NOT_STRING, EMPTY, TOO_LONG = (
    "bad_json", "not_object", "missing_field", "not_string", "empty", "too_long",
)


@dataclass(frozen=True)
class PromptItem:
    """One usable prompt. `index` is the item's position in its dataset (0..len-1)."""

    prompt_ids: list[int]
    prompt_text: str  # the text that was tokenized (after the chat template, if any)
    answer: str
    index: int
    extra: dict[str, Any] = field(default_factory=dict)  # the row's other columns (not prompt / answer)


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str, key: str | None = None):
        super().__init__(detail)
        self.reason = reason
        self.key = key  # the missing key, for MISSING


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt becomes text. `prompt_template`: a format string with "{prompt}" applied to a
    string prompt first (Base models); `system_prompt`: a system message (prepended with "\n" as
    plain text when no chat template is used); `template_kwargs`: extra apply_chat_template kwargs
    (Qwen3's enable_thinking)."""

    apply_chat_template: bool | None = None
    system_prompt: str = ""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_template: str = ""


def lookup(row: dict, key: str) -> Any:
    """row[key], following dots into nested dicts ("reward_model.ground_truth"); KeyError if absent.
    A literal top-level key containing dots wins over the nested reading."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def answer_text(answer: Any) -> str:
    """An answer as the string rewards compare: strings as is, anything else as JSON (42 -> "42")."""
    return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)


@dataclass
class _RowEncoder:
    tokenizer: "PreTrainedTokenizerBase"
    prompt_key: str
    answer_key: str | None
    max_prompt_len: int
    use_chat_template: bool
    fmt: PromptFormat = field(default_factory=PromptFormat)

    def field(self, row: Any, key: str) -> Any:
        if not isinstance(row, dict):
            raise _BadRow(NOT_OBJECT, f"row is {type(row).__name__}, not an object")
        try:
            value = lookup(row, key)
        except KeyError:
            value = None
        if value is None:
            raise _BadRow(MISSING, f"missing field {key!r}", key)
        return value

    def messages(self, prompt: Any) -> list[dict[str, str]]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": self._templated(prompt)}]
        else:
            ok = isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
            if not ok:
                raise _BadRow(NOT_STRING, f"field {self.prompt_key!r} is not a string or a chat message list")
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if self.fmt.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.fmt.system_prompt})
        return messages

    def _templated(self, prompt: str) -> str:
        return self.fmt.prompt_template.replace("{prompt}", prompt) if self.fmt.prompt_template else prompt

    def encode(self, row: Any) -> tuple[list[int], str, str]:
        """(prompt_ids, prompt_text, answer) or _BadRow."""
        prompt = self.field(row, self.prompt_key)
        answer = "" if self.answer_key is None else answer_text(self.field(row, self.answer_key))
        if not isinstance(prompt, (str, list)):
            raise _BadRow(NOT_STRING, f"field {self.prompt_key!r} is not a string")
        if isinstance(prompt, str) and not prompt.strip():
            raise _BadRow(EMPTY, f"empty {self.prompt_key!r}")
        if self.answer_key and not answer.strip():
            raise _BadRow(EMPTY, f"empty {self.answer_key!r}")
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                self.messages(prompt), add_generation_prompt=True, tokenize=False, **self.fmt.template_kwargs
            )
            # The template writes its own special tokens (bos); encoding must not add them twice.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            text = self._templated(prompt)
            if self.fmt.system_prompt:
                text = f"{self.fmt.system_prompt}\n{text}"
            ids = self.tokenizer(text)["input_ids"]
        else:
            raise _BadRow(NOT_STRING, f"field {self.prompt_key!r} is a message list but no chat template is used")
        if len(ids) > self.max_prompt_len:
            raise _BadRow(TOO_LONG, f"prompt has {len(ids)} tokens > max_prompt_len={self.max_prompt_len}")
        return list(ids), text, answer

    def extra(self, row: dict) -> dict[str, Any]:
        """The row's columns other than the prompt's and the answer's (top-level names)."""
        used = {self.prompt_key, self.prompt_key.split(".")[0]}
        if self.answer_key is not None and self.answer_key in row:
            used.add(self.answer_key)
        return {k: v for k, v in row.items() if k not in used}


class PromptDataset:
    """A list of PromptItem plus the count of skipped rows by reason (`skip_reasons`)."""

    def __init__(self, items: list[PromptItem], skip_reasons: dict[str, int], source: str):
        self.items = items
        self.skip_reasons = dict(skip_reasons)
        self.source = source

    @property
    def num_skipped(self) -> int:
        return sum(self.skip_reasons.values())

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)

    @classmethod
    def from_records(
        cls,
        records: Iterable[Any],
        tokenizer: "PreTrainedTokenizerBase",
        *,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        max_prompt_len: int = 1024,
        apply_chat_template: bool | None = None,
        source: str = "records",
        fmt: PromptFormat | None = None,
    ) -> "PromptDataset":
        """Build from dicts. Locations in warnings read `<source> row <i>` (0-based).

        `prompt_key`'s value is a string, or a list of {"role", "content"} messages when a chat
        template is used. `answer_key=None` means no answer (answer ""). `apply_chat_template`:
        None = use the tokenizer's chat template when it has one (rendered with
        add_generation_prompt=True), else plain encoding (with the tokenizer's special tokens).
        `fmt`: system prompt, prompt template and template kwargs (PromptFormat); its
        apply_chat_template is overridden by the argument of that name when that is not None.
        """
        rows = ((f"{source} row {i}", row) for i, row in enumerate(records))
        return cls._build(rows, tokenizer, prompt_key, answer_key, max_prompt_len, apply_chat_template, source, fmt)

    @classmethod
    def from_jsonl(cls, path: str, tokenizer: "PreTrainedTokenizerBase", **kwargs: Any) -> "PromptDataset":
        """Build from a JSONL file (one JSON object per line; blank lines are ignored).

        Keyword arguments as for `from_records`. Warnings name `path:line` (1-based).
        """
        return cls._build(_jsonl_rows(path), tokenizer, source=path, **_encoder_kwargs(kwargs))

    @classmethod
    def from_parquet(cls, path: str, tokenizer: "PreTrainedTokenizerBase", **kwargs: Any) -> "PromptDataset":
        """Build from a Parquet file, read in record batches. Warnings name `path row <i>` (0-based).

        A missing prompt or answer column (the first part of a dotted key) is a ValueError naming it.
        """
        opts = _encoder_kwargs(kwargs)
        return cls._build(_parquet_rows(path, opts["prompt_key"], opts["answer_key"]), tokenizer, source=path, **opts)

    @classmethod
    def _build(
        cls,
        rows: Iterable[tuple[str, Any]],
        tokenizer: "PreTrainedTokenizerBase",
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        max_prompt_len: int = 1024,
        apply_chat_template: bool | None = None,
        source: str = "records",
        fmt: PromptFormat | None = None,
    ) -> "PromptDataset":
        fmt = fmt or PromptFormat()
        requested = fmt.apply_chat_template if apply_chat_template is None else apply_chat_template
        encoder = _RowEncoder(tokenizer, prompt_key, answer_key, max_prompt_len,
                              _use_template(tokenizer, requested), fmt)
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        items, reasons, missing = [], Counter(), Counter()
        for location, row in rows:
            try:
                if isinstance(row, _BadRow):
                    raise row
                ids, text, answer = encoder.encode(row)
            except _BadRow as bad:
                reasons[bad.reason] += 1
                missing[bad.key] += bad.key is not None
                if sum(reasons.values()) <= MAX_LOGGED_BAD_ROWS:
                    logger.warning("%s: skipped bad row (%s): %s", location, bad.reason, bad)
                continue
            items.append(PromptItem(ids, text, answer, len(items), encoder.extra(row)))
        return cls._finish(items, reasons, source, prompt_key, +missing)

    @classmethod
    def _finish(cls, items: list[PromptItem], reasons: Counter, source: str, prompt_key: str,
                missing: Counter) -> "PromptDataset":
        if reasons:
            logger.warning("%s: skipped %d bad rows %s; kept %d", source, sum(reasons.values()), dict(reasons), len(items))
        if not items:
            absent = f"; rows missing key: {dict(missing)}" if missing else ""
            raise ValueError(
                f"{source}: no valid rows (prompt_key={prompt_key!r}){absent}; skipped by reason: {dict(reasons)}"
            )
        return cls(items, reasons, source)


def _use_template(tokenizer: "PreTrainedTokenizerBase", requested: bool | None) -> bool:
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if requested and not has_template:
        raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
    return has_template if requested is None else requested


_ENCODER_KEYS = ("prompt_key", "answer_key", "max_prompt_len", "apply_chat_template", "fmt")


def _encoder_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(_ENCODER_KEYS))
    if unknown:
        raise ValueError(f"unknown dataset option(s) {unknown}; known: {list(_ENCODER_KEYS)}")
    return {"prompt_key": "prompt", "answer_key": "answer", **kwargs}


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row: Any = json.loads(line)
            except json.JSONDecodeError as err:
                row = _BadRow(BAD_JSON, f"unparsable JSON: {err}")
            yield f"{path}:{line_no}", row


def _parquet_rows(path: str, prompt_key: str, answer_key: str | None) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    columns = parquet.schema_arrow.names
    for key in (prompt_key, answer_key):
        if key is not None and key not in columns and key.split(".")[0] not in columns:
            raise ValueError(f"{path}: no column {key!r}; columns are {columns}")
    row_index = 0
    for batch in parquet.iter_batches(batch_size=4096):  # every column: the others are the rows' extra
        for row in batch.to_pylist():
            yield f"{path} row {row_index}", row
            row_index += 1
