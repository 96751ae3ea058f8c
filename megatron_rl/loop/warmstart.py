"""Tiny built-in model for the CPU demo: build it from a config, then a short SFT warm start.

The result is an ordinary HF folder (config.json, safetensors, tokenizer), cached under a key of
everything that shapes it, so every run of a comparison (bf16, fp8, fp8 + calibrated clipping)
starts from bitwise the same weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _cache_key(cfg) -> str:
    shape = {k: v for k, v in vars(cfg.model).items() if k.startswith("tiny_")}
    parts = dict(shape, task=cfg.data.task, sft_steps=cfg.train.sft_steps, sft_lr=cfg.train.sft_lr,
                 sft_batch_size=cfg.train.sft_batch_size, seed=cfg.train.seed, version=1)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def prepare_tiny_model(cfg, cache_root: str | Path) -> Path:
    """Return an HF folder with the warm-started tiny model for `cfg.data.task` (built once)."""
    out = Path(cache_root) / f"tiny-{cfg.data.task}-{_cache_key(cfg)}"
    if (out / "config.json").exists():
        return out
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    from megatron_rl.models.tiny import make_tiny_hf_model, tiny_model_kwargs

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(cfg.train.seed)
    model = make_tiny_hf_model(cfg.model.tiny_arch, None, **tiny_model_kwargs(cfg.model, tokenizer))
    if cfg.train.sft_steps > 0:
        sft_warm_start(model, tokenizer, cfg)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)  # atomic: a half-built folder never looks complete
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp)  # a concurrent run published the same (deterministic) model first
    return out


def _sft_batch(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, S] and a target mask [B, S] over the answer tokens."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(pairs), width)
    for row, (p, a) in enumerate(pairs):
        ids[row, : len(p) + len(a)] = torch.tensor(p + a)
        mask[row, len(p): len(p) + len(a)] = 1.0
    return ids, mask


def sft_warm_start(model, tokenizer, cfg) -> list[float]:
    """Cross-entropy on answer tokens (eos included) with AdamW; returns the loss curve."""
    from megatron_rl.data.tasks import sft_examples

    num = cfg.train.sft_steps * cfg.train.sft_batch_size
    pairs = sft_examples(cfg.data.task, tokenizer, num, seed=cfg.train.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.train.sft_steps)
    model.train()
    losses = []
    for step in range(cfg.train.sft_steps):
        chunk = pairs[step * cfg.train.sft_batch_size: (step + 1) * cfg.train.sft_batch_size]
        ids, mask = _sft_batch(chunk, tokenizer.pad_token_id)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == cfg.train.sft_steps - 1:
            log.info("sft warm start step %d/%d loss %.4f", step + 1, cfg.train.sft_steps, loss.item())
    model.eval()
    return losses
