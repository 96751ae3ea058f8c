"""Prompt datasets (JSONL, Parquet, records), the resumable loader, and built-in tiny tasks."""

from megatron_rl.data.char_tokenizer import build_char_tokenizer, load_char_tokenizer
from megatron_rl.data.datasets import PromptDataset, PromptItem
from megatron_rl.data.loader import PromptLoader
from megatron_rl.data.tasks import TASKS, TaskSpec, get_task, make_task_dataset, sft_examples

__all__ = [
    "TASKS",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "TaskSpec",
    "build_char_tokenizer",
    "get_task",
    "load_char_tokenizer",
    "make_task_dataset",
    "sft_examples",
]
