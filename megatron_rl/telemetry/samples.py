"""Sample dumps: prompt, response, reward (and components), advantage, length and finish reason of
a step's first samples, one JSON object per line in `samples/step_XXXXXX.jsonl`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def sample_records(prompts: list[str], responses: list[str], rewards: list[float], advantages: list[float],
                   lengths: list[int], finish_reasons: list[str], answers: list[str],
                   components: dict[str, list[float]], limit: int) -> list[dict[str, Any]]:
    """The first `limit` samples as dicts; `components` maps a reward component to one value per sample."""
    out = []
    for i in range(min(limit, len(responses))):
        out.append({"index": i, "prompt": prompts[i], "response": responses[i], "answer": answers[i],
                    "reward": rewards[i], **{f"reward/{k}": v[i] for k, v in sorted(components.items())},
                    "advantage": advantages[i], "response_length": lengths[i], "finish_reason": finish_reasons[i]})
    return out


def write_samples(log_dir: str | Path, step: int, records: list[dict[str, Any]]) -> Path:
    """Write `log_dir/samples/step_<step:06d>.jsonl` atomically (a reader never sees half a file)."""
    folder = Path(log_dir) / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)
    return path
