"""The console: a step is numbered as metrics.jsonl and the sample dumps number it, the reward's errors
and timeouts are on its line, and the eval metrics of a step that has them get a line of their own."""

import json
import logging

from megatron_rl.telemetry.logger import MetricsLogger, eval_line, step_line
from megatron_rl.telemetry.samples import write_samples


def test_the_console_numbers_steps_as_the_metrics_and_the_dumps(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, tensorboard=False, progress=False, total_steps=5)
    with caplog.at_level(logging.INFO, logger="megatron_rl.telemetry"):
        for step in (0, 1, 2):
            logger.log(step, {"reward/mean": 0.5, "reward/errors": float(step), "reward/timeouts": 2.0 * step})
            write_samples(tmp_path, step, [{"prompt": "p"}])
    logger.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.telemetry"]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    dumped = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "samples").glob("step_*.jsonl"))
    assert [int(line.split()[1].split("/")[0]) for line in lines] == logged == dumped == [0, 1, 2]
    assert lines[2] == "step 2/5 reward 0.5 rerr 2 rtmo 4"


def test_eval_metrics_get_a_console_line():
    metrics = {"eval/aime24/avg@32": 0.25, "eval/aime24/pass@32": 0.6, "eval/aime24/bf16/avg@32": 0.3,
               "eval/aime24/time": 12.0, "eval/aime24/response_length/mean": 900.0, "eval/math500/maj@4": 0.5,
               "eval/math500/reward_errors": 3.0, "eval/math500/reward_timeouts": 0.0, "reward/mean": 0.1}
    assert eval_line(7, metrics) == ("eval at step 7: aime24/avg@32 0.25 aime24/bf16/avg@32 0.3 aime24/pass@32 0.6 "
                                     "math500/maj@4 0.5 math500/reward_errors 3 math500/reward_timeouts 0")
    assert eval_line(7, {"reward/mean": 0.1}) is None


def test_a_logged_step_with_eval_metrics_prints_them_with_or_without_the_bar(tmp_path, caplog):
    for progress in (False, True):
        logger = MetricsLogger(tmp_path / str(progress), tensorboard=False, progress=progress, total_steps=2)
        with caplog.at_level(logging.INFO, logger="megatron_rl.telemetry"):
            logger.log(1, {"reward/mean": 0.5, "eval/h/avg@4": 0.75})
        logger.close()
        assert "eval at step 1: h/avg@4 0.75" in [r.getMessage() for r in caplog.records]
        caplog.clear()
    assert step_line(1, 2, {"eval/h/avg@4": 0.75}) == "step 1/2"  # not repeated on the step's line
