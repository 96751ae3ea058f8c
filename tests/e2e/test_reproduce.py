"""The precision-study harness, two variants and a few steps: the report comes out with numbers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.tiny_hidden_size=64", "model.tiny_ffn_hidden_size=128", "train.sft_steps=20",
         "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
         "train.micro_batch_size=8", "calib.period=1", "reward.name=position_match",
         "eval.datasets=[{name: heldout, task: sort, n_samples: 4, max_examples: 8, metrics: [avg@4]}]"]


def _cells(md: str, measurement: str) -> list[str]:
    row = next(line for line in md.splitlines() if f"| {measurement} |" in line)
    return [c.strip() for c in row.strip("|").split("|")[2:]]


def test_harness_writes_a_report_with_finite_numbers(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples" / "reproduce" / "run.py"), "--variants", "bf16",
           "fp8_tensorwise_calibrated", "--steps", "2", "--runs-dir", str(tmp_path / "runs"),
           "--out", str(tmp_path / "report"), *SMALL]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| bf16 | fp8_tensorwise_calibrated |" in md
    for measurement in ("std of log r at theta_old (pure precision noise)", "max entropy over the run (TIS on in every run)"):
        for cell in _cells(md, measurement):
            assert math.isfinite(float(cell)), (measurement, cell)
    bf16, fp8 = _cells(md, "false lower-clip rate P(r8 < L, r16 >= 1-eps; A<0)")
    assert bf16 == "" and 0.0 <= float(fp8) <= 1.0  # only FP8 runs have a BF16 shadow
    assert float(_cells(md, "calibrated L (applied)")[1]) > 0
    for png in ("learning.png", "clipping.png", "bounds.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
    head = next(line for line in md.splitlines() if line.startswith("| run |")).strip("|").split("|")
    row = next(line for line in md.splitlines() if line.startswith("| bf16 ")).strip("|").split("|")
    for title in ("heldout avg@4 first", "heldout avg@4 last"):  # held-out accuracy next to the training reward
        assert 0.0 <= float(row[[h.strip() for h in head].index(title)]) <= 1.0, title


def test_surge_harness_screens_then_reuses_the_screen_runs_in_the_arms(tmp_path):
    run_py = str(ROOT / "examples" / "reproduce" / "run.py")
    common = ["--study", "surge", "--steps", "2", "--runs-dir", str(tmp_path / "runs"), *SMALL,
              "rollout.max_new_tokens=12"]
    screen = [sys.executable, run_py, *common, "--stage", "screen", "--variants", "chain_bf16", "chain_nvfp4",
              "--out", str(tmp_path / "screen")]
    proc = subprocess.run(screen, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "screen" / "report.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| run |"))
    assert "surge step" in head and "garbled rate, last quarter" in head
    assert "| chain_bf16 s1 |" in md and "| chain_nvfp4 s1 |" in md
    std = _cells(md, "std of log r at theta_old (pure precision noise)")
    assert float(std[0]) == 0 and float(std[1]) > 0  # NVFP4 recomputes theta_old with noise; BF16 does not
    stamps = {name: (tmp_path / "runs" / f"{name}_seed1" / "stdout.log").stat().st_mtime_ns
              for name in ("chain_bf16", "chain_nvfp4")}
    arms = [sys.executable, run_py, *common, "--stage", "arms", "--setting", "chain_nvfp4", "--out", str(tmp_path / "arms")]
    proc = subprocess.run(arms, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, stamp in stamps.items():  # seed 1 of the baseline and of vanilla: the screen's runs, not re-run
        assert (tmp_path / "runs" / f"{name}_seed1" / "stdout.log").stat().st_mtime_ns == stamp
    md = (tmp_path / "arms" / "report.md").read_text()
    assert "| chain_bf16 | chain_nvfp4 | chain_nvfp4_tis | chain_nvfp4_calibrated | chain_nvfp4_lower_only |" in md
    assert float(_cells(md, "calibrated L (applied)")[3]) > 0


def test_heldout_stage_runs_the_primary_pair_first_and_reports_intervals(tmp_path):
    sys.path.insert(0, str(ROOT / "examples" / "reproduce"))
    from run import HELDOUT_ARMS, heldout_jobs

    order = heldout_jobs(HELDOUT_ARMS, [1, 2, 3])
    primary = {"heldout_nvfp4_tis", "heldout_nvfp4_calibrated_tis"}
    assert {name for name, _ in order[:6]} == primary and [s for _, s in order[:6]] == [1, 1, 2, 2, 3, 3]
    assert len(order) == 15 and not primary & {name for name, _ in order[6:]}

    run_py = str(ROOT / "examples" / "reproduce" / "run.py")
    cmd = [sys.executable, run_py, "--study", "surge", "--stage", "heldout", "--steps", "2", "--seeds", "1", "2",
           "--jobs", "2", "--variants", "heldout_nvfp4_tis", "heldout_nvfp4_calibrated_tis",
           "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "arms"), *SMALL, "rollout.max_new_tokens=12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = [sys.executable, str(ROOT / "examples" / "reproduce" / "heldout_stats.py"),
             "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "heldout")]
    proc = subprocess.run(stats, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "heldout" / "report.md").read_text()
    assert "4 of the 40 declared runs finished" in md
    row = next(line for line in md.splitlines() if line.startswith("| heldout_nvfp4_calibrated_tis |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2 (1,2)" and cells[2][:3] in ("0/2", "1/2", "2/2")
    diff, low, high = (float(x) for x in cells[5].replace("[", " ").replace("]", " ").replace(",", " ").split())
    assert low <= diff <= high and -1.0 <= low and high <= 1.0
    start, end = (float(x) for x in cells[4].split("->"))
    assert 0.0 <= start <= 1.0 and 0.0 <= end <= 1.0
    assert "| heldout_nvfp4_tis vs heldout_nvfp4_calibrated_tis |" in md
    assert (tmp_path / "heldout" / "heldout.png").stat().st_size > 1000


def test_rivals_stage_is_declared_loads_and_reports_against_its_reference(tmp_path):
    """The second held-out study: every arm is a valid config whose knob reaches the config, the
    primary block (reference, forced ratio, BF16 old log-probs, CC) runs first, and the report takes
    differences against the reference arm (synthetic finished runs, difference worked out by hand)."""
    import json

    sys.path.insert(0, str(ROOT / "examples" / "reproduce"))
    from run import HELDOUT_EVAL, RIVAL_ARMS, RIVAL_SEEDS, heldout_jobs

    from megatron_rl.config import load_config

    surge = ROOT / "examples" / "reproduce" / "surge.yaml"
    cfgs = {arm: load_config(surge, [*HELDOUT_EVAL, *o]) for arm, o in RIVAL_ARMS.items()}
    assert cfgs["rivals_nvfp4_force_tis"].algo.force_on_policy_ratio
    assert cfgs["rivals_nvfp4_bf16_old_tis"].algo.old_logprob_precision == "bf16"
    assert cfgs["rivals_nvfp4_calibrated_tis"].calib.enabled
    assert cfgs["rivals_nvfp4_icepop"].algo.tis_mode == "icepop"
    assert cfgs["rivals_nvfp4_dual_clip_tis"].algo.eps_clip_c == 3.0
    assert all(c.precision.train_recipe == "nvfp4" and c.algo.use_tis and c.train.num_steps == 150
               for c in cfgs.values())
    assert sum(c.algo.force_on_policy_ratio for c in cfgs.values()) == 1  # one knob per arm
    order = heldout_jobs(RIVAL_ARMS, RIVAL_SEEDS, list(RIVAL_ARMS)[:4])
    assert len(order) == 24 and {n for n, _ in order[:16]} == set(list(RIVAL_ARMS)[:4])

    runs = tmp_path / "runs"
    finals = {("rivals_nvfp4_tis", 1): 0.1, ("rivals_nvfp4_tis", 2): 0.3,
              ("rivals_nvfp4_force_tis", 1): 0.4, ("rivals_nvfp4_force_tis", 2): 0.6}
    for (arm, seed), acc in finals.items():
        d = runs / f"{arm}_seed{seed}"
        d.mkdir(parents=True)
        records = [{"step": 0, "eval/heldout/avg@4": 0.2, "eval/heldout/bf16/avg@4": 0.2, "entropy": 0.2},
                   {"step": 1, "eval/heldout/avg@4": acc, "eval/heldout/bf16/avg@4": acc, "entropy": 0.3}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (d / "done").write_text("ok\n")
    stats = [sys.executable, str(ROOT / "examples" / "reproduce" / "heldout_stats.py"), "--study", "rivals",
             "--runs-dir", str(runs), "--out", str(tmp_path / "rivals")]
    proc = subprocess.run(stats, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "rivals" / "report.md").read_text()
    assert "4 of the 24 declared runs finished (seeds 1-4" in md
    row = next(line for line in md.splitlines() if line.startswith("| rivals_nvfp4_force_tis |"))
    assert [c.strip() for c in row.strip("|").split("|")][5].startswith("+0.300 [")  # 0.5 - 0.2
    assert "| rivals_nvfp4_tis vs rivals_nvfp4_force_tis |" in md


def test_mechanism_script_on_the_tiny_model(tmp_path):
    """mechanism.py end to end on the tiny model: at theta_old the BF16 path's log-ratio is exactly 0
    (the recompute is bit-reproducible), per-tensor FP8 widens it through the mini-batch's other
    composition alone, and after updates both move."""
    import json

    cmd = [sys.executable, str(ROOT / "examples" / "reproduce" / "mechanism.py"), "--model", "tiny",
           "--recipes", "bf16", "tensorwise", "--batches", "2", "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["recipe"]: r for r in json.loads((tmp_path / "mechanism.json").read_text())["results"]}
    for recipe, res in results.items():
        assert len(res["batches"]) == 2 and len(res["calibrated_oos"]) == 1
        for b in res["batches"]:
            at_old = b["step0"]
            assert at_old["log_r_bf16"]["std"] == 0.0 and at_old["log_r_bf16"]["q99.9"] == 0.0
            moved = [b[s]["log_r_bf16"]["std"] for s in ("step1", "step2")]
            assert 0.0 < moved[0] < moved[1]
            for state in b.values():  # at one bound: false - missed = FP share below - BF16 share below
                c = state["clip"]
                if c["neg_tokens"]:
                    assert c["false_low"] - c["missed_low"] == pytest.approx(c["below_fp"] - c["below_bf16"], abs=1e-12)
            if recipe == "bf16":
                assert at_old["log_r_fp"]["std"] == 0.0 and b["step1"]["log_r_fp"] == b["step1"]["log_r_bf16"]
            else:
                assert at_old["log_r_fp"]["std"] > 1e-3
    assert "| tensorwise | step0 |" in (tmp_path / "mechanism.md").read_text()
    # the answers are sampled once: every recipe measures the same tokens and advantages
    negs = {r: [b["step0"]["clip"]["neg_tokens"] for b in res["batches"]] for r, res in results.items()}
    assert negs["bf16"] == negs["tensorwise"] and min(negs["bf16"]) > 0
    # the same command again resumes: nothing is re-measured, the tables are rebuilt from the files
    kept = [*tmp_path.glob("recipe_*.json"), tmp_path / "batches.pt"]
    stamps = {f.name: f.stat().st_mtime_ns for f in kept}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {f.name: f.stat().st_mtime_ns for f in kept} == stamps and len(stamps) == 3
