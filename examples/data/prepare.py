"""Turn a local copy of DeepScaleR, DAPO-Math-17K or AIME (as published on the HF hub) into the
JSONL this framework reads: {"prompt": str, "answer": str, "data_source": str, ...}.

    python examples/data/prepare.py deepscaler deepscaler.json      data/deepscaler.jsonl
    python examples/data/prepare.py dapo       dapo-math-17k.parquet data/dapo_math_17k.jsonl
    python examples/data/prepare.py aime       aime_2024.parquet     data/aime_2024.jsonl

Inputs (the columns each source publishes):
- DeepScaleR (agentica-org/DeepScaleR-Preview-Dataset, deepscaler.json or its parquet
  conversion): problem, answer, solution. The prompt is the problem plus INSTRUCTION.
- DAPO-Math-17K (BytedTsinghua-SIA/DAPO-Math-17k parquet): data_source, prompt (a list of chat
  messages whose user message already asks for "Answer: $Answer"), ability,
  reward_model {ground_truth, style}, extra_info {index}. The published file repeats each problem
  many times; rows are deduplicated by extra_info.index. The prompt is the user message's text.
- AIME (e.g. HuggingFaceH4/aime_2024, Maxwell-Jia/AIME_2024): problem / Problem and
  answer / Answer (integers in some copies), any case. The prompt is the problem plus INSTRUCTION.

`--style dapo` asks for the answer as DAPO-Math-17K does (DAPO_TEMPLATE: the last line reads
"Answer: ..."), for evaluation sets scored like a DAPO run (reward dapo / dapo_accuracy); the DAPO
converter keeps the published prompt, which asks for it already.

Rows without a problem or an answer are dropped and counted. Train with
`data.path=data/X.jsonl reward.name=math_verify` (answers are plain LaTeX or integers), or
`reward.name=dapo` on DAPO-Math-17K (examples/qwen3_14b_dapo).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# DAPO-Math-17K's prompt around a problem (its published user messages read so).
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of "
                 "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                 "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")
STYLES = ("boxed", "dapo")


def read_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a .parquet, .jsonl or .json (a list of objects) file."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            yield from (json.loads(line) for line in f if line.strip())
    elif path.suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        yield from rows
    else:
        raise ValueError(f"{path}: expected .parquet, .jsonl or .json")


def _get(row: dict[str, Any], name: str) -> Any:
    """row[name] in any letter case (AIME copies use Problem / Answer)."""
    for key, value in row.items():
        if key.lower() == name:
            return value
    return None


def _answer(value: Any) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value)
    return text.strip() or None


def instructed(problem: str, style: str) -> str:
    """The prompt of a bare problem: the boxed INSTRUCTION after it, or DAPO_TEMPLATE around it."""
    return DAPO_TEMPLATE.format(problem=problem.strip()) if style == "dapo" else f"{problem.strip()} {INSTRUCTION}"


def deepscaler(rows: Iterable[dict[str, Any]], style: str = "boxed") -> Iterator[dict[str, Any] | None]:
    for row in rows:
        problem, answer = _get(row, "problem"), _answer(_get(row, "answer"))
        yield None if not problem or answer is None else {
            "prompt": instructed(problem, style), "answer": answer, "data_source": "deepscaler"}


def aime(rows: Iterable[dict[str, Any]], style: str = "boxed") -> Iterator[dict[str, Any] | None]:
    for row in rows:
        problem, answer = _get(row, "problem"), _answer(_get(row, "answer"))
        ident = _get(row, "id")
        out = None if not problem or answer is None else {
            "prompt": instructed(problem, style), "answer": answer, "data_source": "aime"}
        if out is not None and ident is not None:
            out["id"] = ident
        yield out


def dapo(rows: Iterable[dict[str, Any]], style: str = "dapo") -> Iterator[dict[str, Any] | None]:
    seen: set[Any] = set()
    for row in rows:
        index = (row.get("extra_info") or {}).get("index")
        if index is not None and index in seen:
            continue  # the published file repeats every problem
        seen.add(index)
        user = [m.get("content") for m in row.get("prompt") or [] if m.get("role") == "user"]
        answer = _answer((row.get("reward_model") or {}).get("ground_truth"))
        yield None if not user or not user[0] or answer is None else {
            "prompt": user[0], "answer": answer, "data_source": row.get("data_source") or "dapo_math_17k",
            "index": index}


CONVERTERS = {"deepscaler": deepscaler, "dapo": dapo, "aime": aime}


def convert(name: str, source: str | Path, out: str | Path, style: str = "boxed") -> dict[str, int]:
    """Write `out` (JSONL, atomically) from `source`; returns {"written", "dropped"}. `style`: the
    instruction added to a bare problem (STYLES; DAPO-Math-17K keeps its own prompt)."""
    if style not in STYLES:
        raise ValueError(f"style {style!r}: expected one of {list(STYLES)}")
    counts = {"written": 0, "dropped": 0}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in CONVERTERS[name](read_rows(source), style):
            if row is None:
                counts["dropped"] += 1
                continue
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            counts["written"] += 1
    tmp.replace(out)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(CONVERTERS))
    parser.add_argument("source", help="the local copy (.parquet, .jsonl or .json)")
    parser.add_argument("out", help="the JSONL to write")
    parser.add_argument("--style", choices=STYLES, default="boxed",
                        help="instruction added to a bare problem: \\boxed{} (default) or DAPO's 'Answer:'")
    args = parser.parse_args(argv)
    counts = convert(args.dataset, args.source, args.out, args.style)
    print(json.dumps({"out": args.out, **counts}))
    return 0 if counts["written"] else 1


if __name__ == "__main__":
    sys.exit(main())
