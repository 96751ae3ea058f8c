"""The mechanism of the paper's claims 1-3 measured directly: no RL run, only forwards, the loop's
own rollouts and a few optimizer steps (docs/reproduction.md, "The mechanism on real weights").

The answers are sampled once, in BF16, from the starting weights theta_0 (the model's own answers;
every recipe sees the same tokens and advantages). Then for each training recipe and batch, from
theta_0 (weights and Adam state restored before every batch), at theta_old and after 1 and k
optimizer steps on the batch (the loop's loss, one mini-batch per step), the ratio of a fixed
mini-batch (half the rows, shuffled as the loop's mini-batches are) against theta_old, in the recipe
(FP8 / FP4) and on the BF16 path of the same weights:

- the distribution of log r (std, 0.1 / 1 / 99 / 99.9% quantiles, share outside the clip window);
- the share of A < 0 tokens below L = 1 - eps in the recipe and in BF16, the false lower clips
  (r8 < L, r16 >= L) and the missed ones (r8 >= L, r16 < L), per A < 0 token;
- the L Calibrated Clipping fits after 1 step on batch j, scored on batch j + 1 after 1 step (out of
  sample), next to the default L on the same tokens.

  python examples/reproduce/mechanism.py --model tiny --out /tmp/mech              # minutes, CPU
  python examples/reproduce/mechanism.py --model real --out docs/reproduction/mechanism   # SmolLM2-135M

The sampled batches (`batches.pt`) and each finished recipe (`recipe_<name>.json`) are kept in the
output folder: the same command resumes after an interruption. Seconds per phase are recorded.
The real model needs the [real] extra (megatron_rl.convert.gguf_to_hf) and the word_math task.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("tensorwise", "blockwise", "mxfp8", "nvfp4")
QUANTILES = (0.001, 0.01, 0.99, 0.999)
TINY = ["model.tiny_hidden_size=64", "model.tiny_ffn_hidden_size=128", "model.tiny_num_layers=1",
        "train.sft_steps=20", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=8", "train.micro_batch_size=4", "reward.name=position_match", "eval.datasets=[]",
        "checkpoint.keep_best=", "log.tensorboard=false", "log.plot=false", "log.progress=false"]
# The declared measurement on SmolLM2-135M-Instruct (docs/reproduction.md): 3 batches of 4 prompts x 8
# answers of word_math at temperature 0.6, answers up to 96 tokens. The base config is the real-model
# recipe; these keys are the measurement's own.
REAL = ["data.task=word_math", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=8",
        "rollout.max_new_tokens=96", "rollout.temperature=0.6", "train.micro_batch_size=8"]
FIXED = ["precision.rollout_quant=bf16", "train.num_mini_batches=1", "train.ppo_epochs=1",
         "calib.enabled=false", "calib.diagnose=false", "calib.smoothing=1.0", "train.colocated_protocol=false",
         "checkpoint.save_final=false", "algo.kl_loss_coef=0.0"]


@dataclass
class ClipStats:
    """Per A < 0 token (NaN without any): lower-clip shares and the false / missed clips."""

    below_fp: float
    below_bf16: float
    false_low: float
    missed_low: float
    neg_tokens: int


def clip_stats(log_r_fp: torch.Tensor, log_r_bf16: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               low: float, ref_low: float) -> ClipStats:
    """[B, T] log-ratios of the recipe and of BF16 on the same tokens, advantages and response mask.
    A token is lower-clipped when r < bound strictly (policy_loss's rule); the recipe's ratio is
    judged at `low` (the bound in force), BF16's at `ref_low` (1 - eps)."""
    neg = mask.bool() & (adv < 0)
    n = int(neg.sum())
    fp = (log_r_fp < math.log(low)) & neg
    bf = (log_r_bf16 < math.log(ref_low)) & neg

    def share(t: torch.Tensor) -> float:
        return float(t.sum()) / n if n else math.nan
    return ClipStats(share(fp), share(bf), share(fp & ~bf), share(~fp & bf), n)


def log_ratio_stats(log_r: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> dict[str, float]:
    """std (population), quantiles and the share of response tokens with r outside [low, high]."""
    vals = log_r[mask.bool()].double()
    out = {"std": float(vals.std(unbiased=False)) if vals.numel() else math.nan,
           "outside": float(((vals < math.log(low)) | (vals > math.log(high))).double().mean())}
    for q in QUANTILES:
        out[f"q{q * 100:g}"] = float(torch.quantile(vals, q)) if vals.numel() else math.nan
    return out


def _forward(run, batch: dict, fp8: bool) -> torch.Tensor:
    """Log-probs [B, S] in the training recipe (fp8) or on the BF16 path, micro-batched as training."""
    mbs = run.cfg.train.micro_batch_size
    rows = batch["tokens"].shape[0]
    pad = -rows % mbs
    padded = {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]) if pad else v for k, v in batch.items()}
    out = run.actor.compute_logprobs(padded, micro_batch_size=mbs, with_entropy=False, fp8=fp8)["logprobs"]
    return out[:rows]


def _rows(batch: dict, rows: torch.Tensor) -> dict:
    return {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}


def measure_state(run, mb: dict, old_fp: torch.Tensor, old_bf16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed mini-batch's log-ratios against theta_old: recipe / recipe and BF16 / BF16."""
    mask = mb["loss_mask"].bool()
    fp = torch.where(mask, _forward(run, mb, True) - old_fp, 0.0)
    bf = torch.where(mask, _forward(run, mb, False) - old_bf16, 0.0)
    return fp, bf


def _state_record(fp, bf, mb, eps_low: float, eps_high: float) -> dict:
    low, high, mask, adv = 1.0 - eps_low, 1.0 + eps_high, mb["loss_mask"], mb["advantages"]
    return {"log_r_fp": log_ratio_stats(fp, mask, low, high), "log_r_bf16": log_ratio_stats(bf, mask, low, high),
            "clip": asdict(clip_stats(fp, bf, adv, mask, low, low))}


def measure_batch(run, batch: dict, step: int, k: int) -> tuple[dict, tuple]:
    """One batch from theta_0: old log-probs in the recipe (the loop's prepare) and in BF16, the fixed
    mini-batch measured at theta_old, then after each of k optimizer steps (states 0, 1 and k
    recorded). Returns the records and the (fp, bf16, mini-batch) tensors after one step."""
    from megatron_rl.loop import phases

    metrics: dict[str, float] = {}
    batch = phases.prepare(run, batch, step, metrics)
    if batch is None:
        raise RuntimeError(f"batch {step}: non-finite old log-probs ({metrics})")
    old_bf16 = _forward(run, batch, False)
    rows = batch["tokens"].shape[0]
    # a mini-batch as the loop draws one (shuffled rows): micro-batches composed unlike the old pass's
    half = torch.randperm(rows, generator=torch.Generator().manual_seed(step))[: rows // 2]
    mb = _rows(batch, half)
    a = run.cfg.algo
    records, after_one = {}, None
    for s in range(k + 1):
        if s:
            phases.update_policy(run, batch, step)
        if s in (0, 1, k):
            fp, bf = measure_state(run, mb, batch["old_logprobs"][half], old_bf16[half])
            records[f"step{s}"] = _state_record(fp, bf, mb, a.eps_clip, a.eps_clip)
            after_one = (fp, bf, mb) if s == 1 else after_one
    return records, after_one


def _params(actor) -> list[torch.Tensor]:
    return [p for chunk in actor.model for p in chunk.parameters()]


def restore_theta0(actor, theta0: list[torch.Tensor]) -> None:
    """Weights back to theta_0 and a fresh Adam state (zero moments, step 0), as after the build."""
    from megatron_rl.actor.build import materialize_adam_state

    with torch.no_grad():
        for p, saved in zip(_params(actor), theta0, strict=True):
            p.copy_(saved)
    actor._reload_main_params()  # FP32 master copies under BF16 mixed precision
    for chained in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        chained.optimizer.state.clear()
    materialize_adam_state(actor.optimizer)


def sample_batches(config: Path, overrides: list[str], batches: int, log_dir: Path) -> list[dict]:
    """The model's own answers at theta_0: the loop's rollout (BF16 engine) and advantages, once."""
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.config import load_config
    from megatron_rl.loop import build, phases

    cfg = load_config(config, [*overrides, *FIXED, "precision.train_recipe=bf16", f"log.dir={log_dir}"])
    run = build.build_run(cfg)
    try:
        run.sync.sync()
        out = []
        for j in range(batches):
            rollout = phases.generate(run, run.loader.next_batch(), j)
            if rollout.batch is None:
                raise RuntimeError(f"batch {j}: every group was dropped")
            out.append({key: v.clone() for key, v in rollout.batch.items()})
    finally:
        run.finish()
        destroy_parallel()
    return out


def calibrated_oos(run, fitted_on: tuple, scored_on: tuple) -> dict:
    """L fitted by the controller on one batch's ratios after one step, scored on the next batch's
    (out of sample), with the default L on the same tokens."""
    fp, bf, mb = fitted_on
    eps = run.cfg.algo.eps_clip
    out = run.controller.update(fp.exp(), bf.exp(), mb["advantages"], mb["loss_mask"], step=0)
    low = run.controller.bounds[0]
    fp2, bf2, mb2 = scored_on
    return {"low": low, "high": run.controller.bounds[1], "skipped": out.get("calib/skipped", 0.0),
            "calibrated": asdict(clip_stats(fp2, bf2, mb2["advantages"], mb2["loss_mask"], low, 1.0 - eps)),
            "default": asdict(clip_stats(fp2, bf2, mb2["advantages"], mb2["loss_mask"], 1.0 - eps, 1.0 - eps))}


def measure_recipe(config: Path, overrides: list[str], recipe: str, batches: list[dict], k: int,
                   log_dir: Path) -> dict:
    import time

    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.config import load_config
    from megatron_rl.loop import build

    cfg = load_config(config, [*overrides, *FIXED, f"precision.train_recipe={recipe}", f"log.dir={log_dir}"])
    run = build.build_run(cfg)
    try:
        theta0 = [p.detach().clone() for p in _params(run.actor)]
        per_batch, after, seconds = [], [], []
        for j, batch in enumerate(batches):
            t0 = time.perf_counter()
            restore_theta0(run.actor, theta0)
            records, one = measure_batch(run, {key: v.clone() for key, v in batch.items()}, j, k)
            per_batch.append(records)
            after.append(one)
            seconds.append(round(time.perf_counter() - t0, 1))
        oos = [calibrated_oos(run, a, b) for a, b in zip(after, after[1:])]
    finally:
        run.finish()
        destroy_parallel()
    return {"recipe": recipe, "batches": per_batch, "calibrated_oos": oos, "seconds_per_batch": seconds}


def _mean(vals) -> float:
    vals = [v for v in vals if v == v]
    return sum(vals) / len(vals) if vals else math.nan


def summary_table(results: list[dict], k: int) -> str:
    """Batch means per recipe and state."""
    rows = ["| recipe | state | std log r FP / BF16 | q0.1 / q99.9 FP | outside window FP / BF16 "
            "| A<0 below L FP / BF16 | false / missed lower clip | CC L (OOS): below FP vs BF16, false / missed "
            "| default L on those tokens: false / missed |", "|" + "---|" * 9]
    for res in results:
        for state in ("step0", "step1", f"step{k}"):
            # the batches the declared rules count (with A<0 tokens); all of them when none has any
            counted = [b for b in res["batches"] if b["step0"]["clip"]["neg_tokens"] > 0] or res["batches"]
            recs = [b[state] for b in counted]

            def m(*path):
                vals = []
                for r in recs:
                    for p in path:
                        r = r[p]
                    vals.append(r)
                return _mean(vals)
            cc = ""
            if state == "step1" and res["calibrated_oos"]:
                o = res["calibrated_oos"]
                cc = (f"L {_mean([x['low'] for x in o]):.3f}: {_mean([x['calibrated']['below_fp'] for x in o]):.4f} vs "
                      f"{_mean([x['calibrated']['below_bf16'] for x in o]):.4f}, "
                      f"{_mean([x['calibrated']['false_low'] for x in o]):.4f} / "
                      f"{_mean([x['calibrated']['missed_low'] for x in o]):.4f}")
                default = (f"{_mean([x['default']['false_low'] for x in o]):.4f} / "
                           f"{_mean([x['default']['missed_low'] for x in o]):.4f}")
            else:
                default = ""
            rows.append(
                f"| {res['recipe']} | {state} | {m('log_r_fp', 'std'):.4g} / {m('log_r_bf16', 'std'):.4g} "
                f"| {m('log_r_fp', 'q0.1'):.3g} / {m('log_r_fp', 'q99.9'):.3g} "
                f"| {m('log_r_fp', 'outside'):.4f} / {m('log_r_bf16', 'outside'):.4f} "
                f"| {m('clip', 'below_fp'):.4f} / {m('clip', 'below_bf16'):.4f} "
                f"| {m('clip', 'false_low'):.4f} / {m('clip', 'missed_low'):.4f} | {cc} | {default} |")
    return "\n".join(rows)


def _most(flags: list[bool]) -> bool:
    """The declaration's "most": at least 2 of 3 batches, or both of 2 (more than half, and 2 at least)."""
    return len(flags) >= 2 and sum(flags) >= max(2, len(flags) // 2 + 1)


def verdicts(res: dict, k: int) -> dict[str, str]:
    """The declared rules of docs/reproduction.md ("What counts") applied to one recipe's batches.
    Only batches with A < 0 tokens count; pairs only where the scored batch has them."""
    valid = [b for b in res["batches"] if b["step0"]["clip"]["neg_tokens"] > 0]
    states = ("step1", f"step{k}")
    out = {"batches": f"{len(valid)} of {len(res['batches'])} with A<0 tokens"}

    def all_states(test) -> bool:
        return all(_most([test(b[s]) for b in valid]) for s in states)
    at_old = [b["step0"] for b in valid]
    bf16_zero = all(r["log_r_bf16"]["std"] == 0.0 for r in at_old)
    fp_above = [r["log_r_fp"]["std"] > 0.0 for r in at_old]
    out["control"] = ("BF16 log r exactly 0 at theta_old" if bf16_zero else "BF16 log r NOT 0 at theta_old") + (
        f"; recipe above 0 in {sum(fp_above)} of {len(fp_above)} (composition effect)")
    out["claim1"] = "confirmed" if all_states(lambda r: r["log_r_fp"]["std"] > r["log_r_bf16"]["std"]) else "not confirmed"
    if all_states(lambda r: r["clip"]["below_fp"] > r["clip"]["below_bf16"]):
        out["claim2"] = "confirmed"
    elif all_states(lambda r: r["clip"]["below_fp"] < r["clip"]["below_bf16"]):
        out["claim2"] = "contradicted"
    else:
        out["claim2"] = "neither"
    if all_states(lambda r: r["clip"]["false_low"] > r["clip"]["missed_low"]):
        out["claim3"] = "confirmed as a bias"
    elif all_states(lambda r: r["clip"]["missed_low"] > r["clip"]["false_low"]):
        out["claim3"] = "reversed (missed exceed false)"
    else:
        out["claim3"] = "noise, not bias"
    pairs = [o for o in res["calibrated_oos"] if o["calibrated"]["neg_tokens"] > 0]

    def gap(x) -> float:  # how far the share below L is from BF16's below 0.8, and the wrong clips
        return abs(x["below_fp"] - x["below_bf16"]), x["false_low"] + x["missed_low"]

    def both(o, cmp) -> bool:  # strictly, on both counts: equal bounds are neither better nor worse
        (c_gap, c_wrong), (d_gap, d_wrong) = gap(o["calibrated"]), gap(o["default"])
        return cmp(c_gap, d_gap) and cmp(c_wrong, d_wrong)
    better = [both(o, lambda a, b: a < b) for o in pairs]
    worse = [both(o, lambda a, b: a > b) for o in pairs]
    n = len(res["calibrated_oos"])
    if _most(better):
        out["cc_oos"] = f"better than the default L ({sum(better)} of {len(pairs)} pairs)"
    elif _most(worse):
        out["cc_oos"] = f"worse than the default L ({sum(worse)} of {len(pairs)} pairs)"
    else:
        out["cc_oos"] = (f"not decided: better in {sum(better)}, worse in {sum(worse)} of {len(pairs)} scorable "
                         f"pairs ({n} in all)")
    return out


def verdict_table(results: list[dict], k: int) -> str:
    rows = ["| recipe | batches | control at theta_old | claim 1 | claim 2 (lower) | claim 3 | CC out of sample |",
            "|" + "---|" * 7]
    for res in results:
        v = verdicts(res, k)
        rows.append(f"| {res['recipe']} | {v['batches']} | {v['control']} | {v['claim1']} | {v['claim2']} "
                    f"| {v['claim3']} | {v['cc_oos']} |")
    return "\n".join(rows)


def _model_args(model: str, hf_dir: str) -> tuple[Path, list[str]]:
    if model == "tiny":
        return ROOT / "examples" / "tiny" / "fp8_calibrated.yaml", list(TINY)
    # the recipe's `model.gguf` converts the installed package's GGUF once per machine ([real] extra)
    return ROOT / "examples" / "smollm2_math" / "grpo_fp8_calibrated.yaml", [
        *REAL, *([f"model.hf_dir={hf_dir}", "model.gguf="] if hf_dir else [])]


def _key(config: Path, overrides: list[str], batches: int, steps: int) -> str:
    return json.dumps({"config": config.name, "overrides": overrides, "batches": batches, "steps": steps})


def _cached_batches(out: Path, config: Path, overrides: list[str], batches: int) -> list[dict]:
    """The sampled batches, kept in `out` with the settings that produced them."""
    import time

    path, key = out / "batches.pt", _key(config, overrides, batches, 0)
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key:
            return saved["batches"]
    t0 = time.perf_counter()
    sampled = sample_batches(config, overrides, batches, out / "run_rollout")
    torch.save({"key": key, "batches": sampled, "seconds": time.perf_counter() - t0}, path)
    return sampled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "real"], default="tiny")
    parser.add_argument("--hf-dir", default="", help="real: the converted HF folder (default: the cached one)")
    parser.add_argument("--config", default="", help="base YAML (default: the model's recipe)")
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=["bf16", *RECIPES])
    parser.add_argument("--batches", type=int, default=3, help="batches (>= 2 for the out-of-sample bounds)")
    parser.add_argument("--steps", type=int, default=2, help="k: optimizer steps per batch")
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*", help="extra section.key=value")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.steps < 1:
        parser.error("--batches and --steps must be >= 1")
    config, overrides = _model_args(args.model, args.hf_dir)
    config = Path(args.config) if args.config else config
    if not config.is_file():
        parser.error(f"no base config {config}: pass --config (the real model's recipe)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*overrides, *args.overrides]
    batches = _cached_batches(out, config, overrides, args.batches)
    results = []
    for recipe in args.recipes:
        done = out / f"recipe_{recipe}.json"
        if not done.is_file():
            res = measure_recipe(config, overrides, recipe, batches, args.steps, out / f"run_{recipe}")
            done.write_text(json.dumps({"key": _key(config, overrides, args.batches, args.steps), **res}, indent=1))
        res = json.loads(done.read_text())
        if res.pop("key") != _key(config, overrides, args.batches, args.steps):
            parser.error(f"{done} was measured with other settings: remove it or use another --out")
        results.append(res)
    (out / "mechanism.json").write_text(json.dumps({"model": args.model, "steps": args.steps, "results": results},
                                                   indent=1))
    (out / "mechanism.md").write_text(
        f"# The mechanism, {args.model} model\n\nMeans per recipe and state over the batches with A<0 tokens:\n\n{summary_table(results, args.steps)}\n"
        f"\nThe declared rules (docs/reproduction.md) applied:\n\n{verdict_table(results, args.steps)}\n")
    print(out / "mechanism.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
