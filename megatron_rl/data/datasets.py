"""Prompt datasets from JSONL, Parquet or in-memory records; bad rows are skipped, logged and counted."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PromptDataset", "PromptItem"]

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


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class _RowEncoder:
    tokenizer: "PreTrainedTokenizerBase"
    prompt_key: str
    answer_key: str | None
    max_prompt_len: int
    use_chat_template: bool

    def field(self, row: Any, key: str) -> Any:
        if not isinstance(row, dict):
            raise _BadRow(NOT_OBJECT, f"row is {type(row).__name__}, not an object")
        if key not in row or row[key] is None:
            raise _BadRow(MISSING, f"missing field {key!r}")
        return row[key]

    def messages(self, prompt: Any) -> list[dict[str, str]]:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        ok = isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
        if not ok:
            raise _BadRow(NOT_STRING, f"field {self.prompt_key!r} is not a string or a chat message list")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]

    def encode(self, row: Any) -> tuple[list[int], str, str]:
        """(prompt_ids, prompt_text, answer) or _BadRow."""
        prompt = self.field(row, self.prompt_key)
        answer = "" if self.answer_key is None else self.field(row, self.answer_key)
        if not isinstance(prompt, (str, list)) or not isinstance(answer, str):
            bad_key = self.answer_key if isinstance(prompt, (str, list)) else self.prompt_key
            raise _BadRow(NOT_STRING, f"field {bad_key!r} is not a string")
        if (isinstance(prompt, str) and not prompt.strip()) or (self.answer_key and not answer.strip()):
            raise _BadRow(EMPTY, f"empty {self.prompt_key!r} or {self.answer_key!r}")
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                self.messages(prompt), add_generation_prompt=True, tokenize=False
            )
            # The template writes its own special tokens (bos); encoding must not add them twice.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt)["input_ids"]
        else:
            raise _BadRow(NOT_STRING, f"field {self.prompt_key!r} is a message list but no chat template is used")
        if len(ids) > self.max_prompt_len:
            raise _BadRow(TOO_LONG, f"prompt has {len(ids)} tokens > max_prompt_len={self.max_prompt_len}")
        return list(ids), text, answer


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
    ) -> "PromptDataset":
        """Build from dicts. Locations in warnings read `<source> row <i>` (0-based).

        `prompt_key`'s value is a string, or a list of {"role", "content"} messages when a chat
        template is used. `answer_key=None` means no answer (answer ""). `apply_chat_template`:
        None = use the tokenizer's chat template when it has one (rendered with
        add_generation_prompt=True), else plain encoding (with the tokenizer's special tokens).
        """
        rows = ((f"{source} row {i}", row) for i, row in enumerate(records))
        return cls._build(rows, tokenizer, prompt_key, answer_key, max_prompt_len, apply_chat_template, source)

    @classmethod
    def from_jsonl(cls, path: str, tokenizer: "PreTrainedTokenizerBase", **kwargs: Any) -> "PromptDataset":
        """Build from a JSONL file (one JSON object per line; blank lines are ignored).

        Keyword arguments as for `from_records`. Warnings name `path:line` (1-based).
        """
        return cls._build(_jsonl_rows(path), tokenizer, source=path, **_encoder_kwargs(kwargs))

    @classmethod
    def from_parquet(cls, path: str, tokenizer: "PreTrainedTokenizerBase", **kwargs: Any) -> "PromptDataset":
        """Build from a Parquet file, read in record batches. Warnings name `path row <i>` (0-based).

        A missing prompt or answer column is a ValueError naming the column.
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
    ) -> "PromptDataset":
        encoder = _RowEncoder(
            tokenizer, prompt_key, answer_key, max_prompt_len, _use_template(tokenizer, apply_chat_template)
        )
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        items, reasons = [], Counter()
        for location, row in rows:
            try:
                if isinstance(row, _BadRow):
                    raise row
                ids, text, answer = encoder.encode(row)
            except _BadRow as bad:
                reasons[bad.reason] += 1
                if sum(reasons.values()) <= MAX_LOGGED_BAD_ROWS:
                    logger.warning("%s: skipped bad row (%s): %s", location, bad.reason, bad)
                continue
            items.append(PromptItem(ids, text, answer, len(items)))
        return cls._finish(items, reasons, source, prompt_key)

    @classmethod
    def _finish(cls, items: list[PromptItem], reasons: Counter, source: str, prompt_key: str) -> "PromptDataset":
        if reasons:
            logger.warning("%s: skipped %d bad rows %s; kept %d", source, sum(reasons.values()), dict(reasons), len(items))
        if not items:
            raise ValueError(
                f"{source}: no valid rows (prompt_key={prompt_key!r}); skipped by reason: {dict(reasons)}"
            )
        return cls(items, reasons, source)


def _use_template(tokenizer: "PreTrainedTokenizerBase", requested: bool | None) -> bool:
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if requested and not has_template:
        raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
    return has_template if requested is None else requested


_ENCODER_KEYS = ("prompt_key", "answer_key", "max_prompt_len", "apply_chat_template")


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
        if key is not None and key not in columns:
            raise ValueError(f"{path}: no column {key!r}; columns are {columns}")
    wanted = [k for k in (prompt_key, answer_key) if k is not None]
    row_index = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=wanted):
        for row in batch.to_pylist():
            yield f"{path} row {row_index}", row
            row_index += 1
