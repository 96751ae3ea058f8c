"""Every input of a run checked before expensive work (the actor, servers, the tiny model's warm
start): data and eval files with their columns, the model folder and its tokenizer, the chat
template when asked for, the tasks and reward functions. One ValueError naming the config key.

Headers only: the files are not read whole (the datasets are, at build, before the actor). Every
rank runs it, so no rank goes on to build what another rank's missing file would stop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.data.prompt_file import check_prompt_file
from megatron_rl.data.tasks import get_task
from megatron_rl.loop.run_folder import prepare_log_dir
from megatron_rl.rewards import get_reward_fn

# Where transformers finds a chat template in a local folder (tokenization_utils_base.py,
# from_pretrained: CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR, tokenizer_config.json's chat_template).
CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def prepare_run(cfg: RunConfig) -> RunConfig:
    """What a training runs before any work: every input checked, then log.dir's run resumed,
    refused or overwritten (loop/run_folder.py). Returns cfg with checkpoint.resume resolved to
    true or false; ValueError naming what is wrong."""
    check_inputs(cfg)
    return prepare_log_dir(cfg, int(os.environ.get("RANK", "0")))  # torchrun's global rank


def check_inputs(cfg: RunConfig, load_tokenizer: bool = True) -> None:
    """ValueError naming the key of the first bad input. `load_tokenizer`: also load model.hf_dir's
    tokenizer (imports transformers: about a second), after every cheaper check has passed."""
    d = cfg.data
    columns = {"data.prompt_key": d.prompt_key, "data.answer_key": d.answer_key}
    if d.path:
        check_prompt_file(d.path, columns, "data.path")
    else:
        _check(get_task, d.task, "data.task")
    for i, e in enumerate(cfg.eval.datasets):
        key = f"eval.datasets[{i}]"
        if e.path:
            check_prompt_file(e.path, columns, f"{key}.path")
        if e.task:
            _check(get_task, e.task, f"{key}.task")
        if e.reward:
            _check(get_reward_fn, e.reward, f"{key}.reward")
    _check_model_files(cfg)
    if load_tokenizer and cfg.model.hf_dir:
        _check_tokenizer(cfg)


def _check(lookup, name: str, key: str) -> None:
    try:
        lookup(name)
    except ValueError as err:
        raise ValueError(f"config key '{key}': {err}") from None


def has_chat_template(folder: Path) -> bool:
    """The HF folder ships a chat template (what AutoTokenizer would load as tokenizer.chat_template)."""
    if (folder / CHAT_TEMPLATE_FILE).is_file() or any((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except json.JSONDecodeError as err:
        raise ValueError(f"config key 'model.hf_dir': {config} is not JSON ({err})") from None


def _check_model_files(cfg: RunConfig) -> None:
    m, template = cfg.model, cfg.data.chat_template
    if m.megatron_ckpt and not Path(m.megatron_ckpt).is_dir():
        raise ValueError(f"config key 'model.megatron_ckpt': no such folder {m.megatron_ckpt}")
    if not m.hf_dir:
        if template:
            raise ValueError("config key 'data.chat_template': true, but the built-in tiny model's character "
                             "tokenizer has no chat template (set model.hf_dir, or data.chat_template=false)")
        return
    folder = Path(m.hf_dir)
    if not (folder / "config.json").is_file():
        raise ValueError(f"config key 'model.hf_dir': no HF checkpoint (config.json) in {folder}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"config key 'model.hf_dir': no tokenizer in {folder} (none of {list(TOKENIZER_FILES)})")
    if template and not has_chat_template(folder):
        raise ValueError(f"config key 'data.chat_template': true, but the tokenizer in {folder} has no chat "
                         f"template ({CHAT_TEMPLATE_FILE} or tokenizer_config.json's chat_template)")


def _check_tokenizer(cfg: RunConfig) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"config key 'model.hf_dir': its tokenizer does not load: {err}") from None
    if cfg.data.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"config key 'data.chat_template': true, but the tokenizer of {cfg.model.hf_dir} "
                         "has no chat template")
