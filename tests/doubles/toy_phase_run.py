"""A Run for loop/phases.py without Megatron or an engine: the phases' own code, the real config,
char tokenizer, reward runner and collectives, around a scripted engine and a toy actor.

The engine answers prompt "<digits>=" with one sample per digit d (n = number of digits): response
text d * (j + 1) for sample j (lengths 1..n; `short`: every response is its one digit), the toy
actor's log-probs as rollout log-probs, finish reason "length" when the response reaches
rollout.max_new_tokens. The reward `first_digit` scores a response by its first digit, so a prompt's
digits are its group's rewards.

The toy actor stands in for MegatronActor at its two calls (actor/actor.py): compute_logprobs(batch,
micro_batch_size=, with_entropy=, fp8=, logprob_chunk_size=) -> {"logprobs": [B, S]}, and
train_step(batch, loss_fn, micro_batch_size=, logprob_chunk_size=) -> {"grad_norm", "lr", "skipped",
"loss", "metrics": one dict per micro-batch}; like the real one it splits the batch into row chunks of
micro_batch_size (actor/batch.py split_micro_batches) and calls loss_fn(logprobs, entropy, mb) on
each. Its log-probs are a fixed function of the tokens and it never changes, so every ratio is 1.
Each train_step call is recorded (batch, loss, micro-batch count).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.actor.batch import split_micro_batches
from megatron_rl.data.char_tokenizer import build_char_tokenizer
from megatron_rl.data.datasets import PromptItem
from megatron_rl.rollout.base import Sample


def first_digit(response: str, answer: str) -> float:
    return float(response[0]) if response[:1].isdigit() else 0.0


def toy_logprobs(tokens: torch.Tensor) -> torch.Tensor:
    return -0.01 * (tokens.float() + 1.0)


class ScriptedEngine:
    def __init__(self, tokenizer, max_new_tokens: int):
        self.tokenizer, self.max_new_tokens, self.calls = tokenizer, max_new_tokens, []
        self.short = False  # True: every response is its one digit (length 1)

    def generate(self, prompt_ids, sampling):
        self.calls.append((prompt_ids, sampling))
        out = []
        for i, ids in enumerate(prompt_ids):
            digits = self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("=")
            assert len(digits) == sampling.n, (digits, sampling.n)
            for j, d in enumerate(digits):
                response = self.tokenizer(d * (1 if self.short else j + 1), add_special_tokens=False)["input_ids"]
                rollout_lp = toy_logprobs(torch.tensor(response)).tolist()  # the trainer's: no mismatch
                out.append(Sample(i, list(ids), response, rollout_lp,
                                  "length" if len(response) >= self.max_new_tokens else "stop"))
        return out


class ToyActor:
    def __init__(self):
        self.config = SimpleNamespace(sequence_parallel=False)
        self.lr, self.calls, self.grad_norms = 1e-6, [], []

    def compute_logprobs(self, batch, *, micro_batch_size, with_entropy=False, fp8=True, logprob_chunk_size=0):
        return {"logprobs": toy_logprobs(batch["tokens"])}

    def train_step(self, batch, loss_fn, *, micro_batch_size, logprob_chunk_size=0):
        losses, metrics = [], []
        for mb in split_micro_batches(batch, micro_batch_size):
            loss, m = loss_fn(toy_logprobs(mb["tokens"]), torch.zeros(mb["tokens"].shape), mb)
            losses.append(float(loss))
            metrics.append(m)
        grad_norm = 1.0 + len(self.calls)  # a different norm per update: the mean is checked
        self.calls.append({"batch": batch, "loss": sum(losses), "micro_batches": len(losses),
                           "micro_batch_size": micro_batch_size})
        return {"grad_norm": grad_norm, "lr": self.lr, "skipped": False, "loss": sum(losses), "metrics": metrics}


class ListLoader:
    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


def prompts(tokenizer, groups: list[str], start: int = 0) -> list[PromptItem]:
    """One prompt per digit string (its group's rewards)."""
    return [PromptItem(tokenizer(g + "=")["input_ids"], g + "=", "0", start + i) for i, g in enumerate(groups)]


def toy_parallel(dp_rank: int = 0, dp_size: int = 1, reduce=None):
    reduce = reduce or (lambda t: t)
    return SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, rank=dp_rank, world_size=dp_size, tp_size=1, pp_size=1,
                           tp_rank=0, pp_rank=0, dp_group=None, dp_reducer=lambda: reduce)


def toy_run(cfg, parallel=None, later_batches=(), rewards=None):
    """A run of `cfg` (rollout.n_samples_per_prompt = digits per prompt); `later_batches`: what the
    loader hands refill rounds; `rewards`: a RewardRunner (default: first_digit, one worker)."""
    from megatron_rl.rewards.runner import RewardRunner

    tokenizer = build_char_tokenizer()
    return SimpleNamespace(
        cfg=cfg, tokenizer=tokenizer, parallel=parallel or toy_parallel(), host_groups=None,
        engine=ScriptedEngine(tokenizer, cfg.rollout.max_new_tokens), is_engine_rank=True,
        is_log_rank=parallel is None or parallel.rank == 0, actor=ToyActor(), ref=None, kv_calibration=None,
        rewards=rewards or RewardRunner(first_digit, timeout_s=30.0), loader=ListLoader(later_batches),
        controller=SimpleNamespace(should_calibrate=lambda step: False))
