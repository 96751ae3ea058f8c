"""The `data` section: the prompt dataset, its columns and how prompts are rendered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    task: str = "sort"
    """Built-in task (data/tasks.py): sort, reverse, add, chain for the tiny model; word_math (English
    word problems, math_verify) for a real one. Ignored when `path` is set."""
    path: str = ""
    """Prompt dataset (.jsonl or .parquet)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_len: int = 1024
    """Prompt length cap in tokens (after the chat template); longer rows are skipped, counted and
    logged with their length. Sizes the memory plan with rollout.max_new_tokens, so it is a number,
    not derived from the data. verl's data.max_prompt_length, slime's --rollout-max-prompt-len."""
    num_examples: int = 4096
    """Built-in tasks: how many prompts to generate."""
    prompts_per_step: int = 16
    chat_template: bool | None = None
    """true | false | null (auto). Render prompts with the tokenizer's chat template (a user message,
    add_generation_prompt=True). null: when the tokenizer has one. false: plain text, as zero-RL on a
    Base model usually wants (with prompt_template)."""
    system_prompt: str = ""
    """A system message put before each prompt (a chat list that has one keeps its own); without a
    chat template it is prepended to the text, followed by a newline. Empty = none."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of apply_chat_template, e.g. {enable_thinking: false} for Qwen3."""
    prompt_template: str = ""
    """A format string for a string prompt, with the placeholder "{prompt}" (any other braces are
    literal), applied before the chat template if one is used. Empty = the prompt as is."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (seeded by train.seed and the epoch: resumable)."""
    num_epochs: int = 0
    """Passes over the dataset; the run then ends early (train.num_steps is capped at the number of
    full batches, the last partial batch dropped). 0 = cycle for train.num_steps steps."""


CHOICES: dict[str, tuple] = {}
POSITIVE = ("prompts_per_step", "max_prompt_len")


def check_data(d: DataConfig) -> None:
    if d.num_epochs < 0:
        raise ValueError(f"config key 'data.num_epochs': must be >= 0, got {d.num_epochs}")
    if d.prompt_template and "{prompt}" not in d.prompt_template:
        raise ValueError(f"config key 'data.prompt_template': needs the placeholder {{prompt}}, got {d.prompt_template!r}")
    if d.template_kwargs and d.chat_template is False:
        raise ValueError("config key 'data.template_kwargs': set, but data.chat_template is false (no template to pass them to)")
