"""A calibration step on the tiny pipeline costs two extra BF16 forwards, both on the calibration
rows only (paper.md 1.4), and the FP8 ratio comes from the training forward itself."""

from __future__ import annotations

from megatron_rl.config import load_config
from test_rl_loop import EXAMPLES, TINY


def test_calibration_step_runs_two_bf16_forwards_on_the_calibration_rows(tmp_path):
    from megatron_rl.loop import build, phases
    from megatron_rl.actor.parallel import destroy_parallel

    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*TINY, f"log.dir={tmp_path / 'run'}"])
    run_ = build.build_run(cfg)
    calls = []
    real = run_.actor.compute_logprobs

    def counting(batch, **kw):
        calls.append((int(batch["tokens"].shape[0]), kw["fp8"]))
        return real(batch, **kw)

    run_.actor.compute_logprobs = counting
    try:
        run_.sync.sync()
        per_step = []
        for step in (0, 1):
            calls.clear()
            batch = phases.prepare(run_, phases.generate(run_, run_.loader.next_batch(), step).batch, step, {})
            out = phases.update_policy(run_, batch, step)
            per_step.append((list(calls), out))
        (calls0, out0), (calls1, out1) = per_step
        # 16 rows: the FP8 old log-probs of the whole batch, then BF16 at theta_old and at the
        # current weights on the 8 rows of the calibration mini-batch; nothing more
        assert calls0 == [(16, True), (8, False), (8, False)]
        assert out0["calib/num_calibrations"] + out0["calib/num_skipped"] == 1.0
        assert out0["calib/tokens"] > 0 and "shadow/clip_high_pos_bf16" in out0
        # step 1 is off the period: no shadow unless step 0's calibration failed (then retried)
        expected = [(16, True)] if out0["calib/skipped"] == 0.0 else [(16, True), (8, False), (8, False)]
        assert calls1 == expected and ("calib/tokens" in out1) == (out0["calib/skipped"] == 1.0)
    finally:
        run_.finish()
        destroy_parallel()
