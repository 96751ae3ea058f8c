"""The entropy-surge detector on hand-computed traces, resume, the format checks, the report columns
and the plot marks, and one tiny run whose log carries the health metrics."""

from __future__ import annotations

import logging
import math

import pytest

from megatron_rl.config import HealthConfig, load_config
from megatron_rl.data.tasks import TASKS, TaskSpec
from megatron_rl.telemetry.health import SurgeDetector
from megatron_rl.telemetry.plotting import surge_spans
from megatron_rl.telemetry.report import summary_table
from megatron_rl.telemetry.logger import MetricsLogger

NAN = float("nan")


def _feed(trace, patience=3, rise=0.5, warmup=0, garbled=None):
    """The detector's output per step for an entropy trace (None: the step logs no entropy)."""
    det = SurgeDetector(entropy_rise=rise, patience=patience, warmup_steps=warmup)
    outs = []
    for step, entropy in enumerate(trace):
        metrics = {} if entropy is None else {"entropy": entropy}
        if garbled is not None:
            metrics["health/garbled_rate"] = garbled[step]
        outs.append(det.update(step, metrics))
    return outs


def _col(outs, key):
    return [o.get(key) for o in outs]


def test_flat_trace_never_surges():
    outs = _feed([1.0] * 12)
    assert _col(outs, "health/entropy_min") == [1.0] * 12
    assert _col(outs, "health/entropy_rise") == [0.0] * 12
    assert _col(outs, "health/rise_streak") == [0.0] * 12
    assert _col(outs, "health/surge") == [0.0] * 12
    assert all("health/surge_step" not in o for o in outs)


def test_rise_for_patience_minus_one_steps_is_no_surge():
    outs = _feed([1.0, 1.0, 1.6, 1.6, 1.0, 1.0])
    assert _col(outs, "health/entropy_rise") == pytest.approx([0, 0, 0.6, 0.6, 0, 0])
    assert _col(outs, "health/rise_streak") == [0, 0, 1, 2, 0, 0]
    assert _col(outs, "health/surge") == [0.0] * 6
    assert all("health/surge_step" not in o for o in outs)


def test_rise_for_patience_steps_surges_from_its_onset():
    # rises 0, 0, 0.6, 0.5 (the threshold itself counts), 1.0, 0
    outs = _feed([1.0, 1.0, 1.6, 1.5, 2.0, 1.0])
    assert _col(outs, "health/rise_streak") == [0, 0, 1, 2, 3, 0]
    assert _col(outs, "health/surge") == [0, 0, 0, 0, 1, 0]
    assert _col(outs, "health/surge_step") == [None, None, None, None, 2.0, 2.0]  # onset, kept


def test_default_config_patience_ten():
    det = SurgeDetector.from_config(HealthConfig())
    outs = [det.update(s, {"entropy": 1.0 if s < 5 else 1.5}) for s in range(15)]
    assert _col(outs, "health/surge") == [0.0] * 14 + [1.0]  # steps 5..14: ten rising steps
    assert outs[-1]["health/surge_step"] == 5.0


def test_dip_below_threshold_resets_the_streak():
    outs = _feed([1.0, 1.6, 1.6, 1.2, 1.6, 1.6, 1.6])
    assert _col(outs, "health/rise_streak") == [0, 1, 2, 0, 1, 2, 3]
    assert _col(outs, "health/surge_step") == [None] * 6 + [4.0]


def test_falling_minimum():
    outs = _feed([2.0, 1.5, 1.0, 0.75, 0.5])  # entropy only falls: never a rise
    assert _col(outs, "health/entropy_min") == [2.0, 1.5, 1.0, 0.75, 0.5]
    assert _col(outs, "health/entropy_rise") == [0.0] * 5
    # a rise is measured from the newest minimum: 0.5 / 0.25 - 1 = 1, 0.375 / 0.25 - 1 = 0.5
    outs = _feed([2.0, 1.0, 0.5, 0.25, 0.5, 0.375, 0.5])
    assert _col(outs, "health/entropy_min") == [2.0, 1.0, 0.5, 0.25, 0.25, 0.25, 0.25]
    assert _col(outs, "health/entropy_rise") == [0, 0, 0, 0, 1.0, 0.5, 1.0]
    assert _col(outs, "health/surge_step")[-1] == 4.0


def test_missing_or_nan_entropy_neither_extends_nor_breaks_the_streak():
    outs = _feed([1.0, 1.6, NAN, 1.6, None, 1.6, math.inf])
    assert _col(outs, "health/entropy_rise") == pytest.approx([0, 0.6, None, 0.6, None, 0.6, None])
    assert _col(outs, "health/entropy_min") == [1.0, 1.0, None, 1.0, None, 1.0, None]
    assert _col(outs, "health/rise_streak") == [0, 1, 1, 2, 2, 3, 3]
    assert _col(outs, "health/surge") == [0, 0, 0, 0, 0, 1, 1]
    assert outs[-1]["health/surge_step"] == 1.0


def test_warmup_steps_are_ignored_for_the_minimum():
    trace = [0.5, 0.5, 1.0, 1.6, 1.6, 1.6]
    outs = _feed(trace, warmup=2)
    assert _col(outs, "health/entropy_min") == [None, None, 1.0, 1.0, 1.0, 1.0]
    assert _col(outs, "health/rise_streak") == [0, 0, 0, 1, 2, 3]
    assert outs[-1]["health/surge_step"] == 3.0
    assert _feed(trace)[-1]["health/surge_step"] == 2.0  # without warm-up the min is 0.5


def test_zero_entropy_minimum_is_floored():
    outs = _feed([0.0, 0.1], patience=1)
    assert outs[1]["health/entropy_rise"] == pytest.approx(0.1 / 1e-6 - 1)
    assert outs[1]["health/surge_step"] == 1.0


def test_garbled_surge():
    outs = _feed([1.0] * 5, garbled=[0.1, 0.6, 0.5, 0.7, 0.2])
    assert _col(outs, "health/garbled_streak") == [0, 1, 2, 3, 0]
    assert _col(outs, "health/garbled_surge") == [0, 0, 0, 1, 0]
    assert _col(outs, "health/garbled_surge_step") == [None, None, None, 1.0, 1.0]
    assert all("health/garbled_streak" not in o for o in _feed([1.0] * 3))  # no format check: absent


def test_resume_rebuilds_from_the_logged_history(tmp_path):
    """A run logged through step 16, resumed at step 9 (the logger keeps steps 0..8), continues with
    exactly the health metrics of the uninterrupted run."""
    trace = [1.0, 0.9, 0.8, None, 1.3, 1.3, 0.7, 1.2, 1.1, NAN, 1.1, 1.2, 0.9, 1.3, 1.05, 1.2, 1.3]
    garbled = [0.0, 0.1, 0.6, 0.6, 0.7, 0.2, 0.6, 0.6, 0.6, 0.6, 0.1, 0.0, 0.6, 0.6, 0.6, 0.6, 0.0]

    def log_run(logger, detector, steps):
        outs = []
        for s in steps:
            metrics = {"health/garbled_rate": garbled[s]}
            if trace[s] is not None:
                metrics["entropy"] = trace[s]
            metrics.update(detector.update(s, metrics))
            logger.log(s, metrics)
            outs.append(metrics)
        return outs

    cfg = HealthConfig(entropy_rise=0.5, patience=3)
    full = log_run(MetricsLogger(tmp_path / "a", tensorboard=False, progress=False), SurgeDetector.from_config(cfg),
                   range(17))
    # entropy streak 7, 8, (9: NaN), 10 surges after the resume point; garbled streak 2, 3, 4 before it
    assert "health/surge_step" not in full[9] and full[10]["health/surge_step"] == 7.0
    assert full[4]["health/garbled_surge_step"] == 2.0 and full[9]["health/garbled_streak"] == 4.0
    log_run(MetricsLogger(tmp_path / "b", tensorboard=False, progress=False), SurgeDetector.from_config(cfg),
            range(13))  # stopped after step 12; its checkpoint was at step 9
    logger = MetricsLogger(tmp_path / "b", tensorboard=False, progress=False, start_step=9)
    resumed = log_run(logger, SurgeDetector.from_history(cfg, logger.history), range(9, 17))
    assert resumed == full[9:]


# The format checks, by hand: sort / reverse 3..6 ASCII digits, add 2..3 without a leading zero.
FORMATS = {
    "sort": (["123", "001122", "999999", "000"],
             ["", "12", "1234567", "12a", " 123", "123 ", "-123", "\uff11\uff12\uff13"]),  # last: full-width
    "reverse": (["543", "051413"], ["54", "5141351", "51a13", "51.3"]),
    "add": (["20", "85", "198", "100"], ["", "8", "05", "085", "1000", "8a", "+85"]),
}


@pytest.mark.parametrize("task", sorted(FORMATS))
def test_task_format_checks(task):
    good, bad = FORMATS[task]
    assert [TASKS[task].valid_format(t) for t in good] == [True] * len(good)
    assert [TASKS[task].valid_format(t) for t in bad] == [False] * len(bad)


def test_default_format_check_accepts_any_non_blank_text():
    spec = TaskSpec("echo", lambda rng: ("p", "a"))
    assert spec.valid_format("anything, at all") and not spec.valid_format("") and not spec.valid_format(" \n")
    keyword = TaskSpec("echo", lambda rng: ("p", "a"), valid_format=str.isupper)
    assert keyword.valid_format("AB") and not keyword.valid_format("ab")


@pytest.mark.parametrize("override, key", [("health.entropy_rise=0", "health.entropy_rise"),
                                           ("health.patience=0", "health.patience"),
                                           ("health.warmup_steps=-1", "health.warmup_steps"),
                                           ("health.garbled_rate=1.5", "health.garbled_rate"),
                                           ("health.garbled_rate=0", "health.garbled_rate")])
def test_bad_health_config_names_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def _health_records(rises, garbled, surge_from=None):
    recs = []
    for s, (rise, g) in enumerate(zip(rises, garbled)):
        r = {"step": s, "entropy": 1.0 + rise, "health/entropy_rise": rise, "health/rise_streak": 0.0,
             "health/garbled_rate": g, "health/surge": float(surge_from is not None and s >= surge_from)}
        if surge_from is not None and s >= surge_from:
            r["health/surge_step"] = float(surge_from - 2)
        recs.append(r)
    return recs


def test_report_health_columns():
    runs = {"surged": _health_records([0, 0.1, 0.7, 0.8, 0.9, 0.3, 0.2, 0.1], [0, 0, 0, 0, 0, 0, 0.25, 0.75], 4),
            "calm": _health_records([0, 0.05, 0.2, 0.1], [0.5, 0.5, 0.5, 0.0]),
            "old": [{"step": 0, "entropy": 1.0}]}
    lines = summary_table(runs).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[-3:] == ["surge step", "garbled rate, last quarter", "max entropy rise"]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")][-3:] for line in lines[2:]}
    assert cells["surged"] == ["2", "0.5", "0.9"]  # last quarter: steps 6, 7 -> (0.25 + 0.75) / 2
    assert cells["calm"] == ["-", "0", "0.2"]  # last quarter of 4 steps: step 3 alone
    assert cells["old"] == ["", "", ""]  # no health metrics logged


def test_surge_spans_and_plot_marks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_rl.telemetry.plotting import _mark_surges, plot_runs

    recs = [{"step": s, "entropy": 1.0, "health/surge": float(s in (3, 4, 5, 8)),
             **({"health/surge_step": 1.0} if s >= 3 else {})} for s in range(10)]
    assert surge_spans(recs) == [(3, 5), (8, 8)]
    fig, ax = plt.subplots()
    _mark_surges(ax, recs, "C0")
    assert len(ax.patches) == 2
    assert [line.get_xdata()[0] for line in ax.lines] == [1.0]  # the onset
    plt.close(fig)
    assert plot_runs({"a": recs}, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_first_surge_warns_once(caplog):
    from megatron_rl.train import _add_health

    det = SurgeDetector(patience=2)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.train"):
        for s, e in enumerate([1.0, 2.0, 2.0, 2.0, 1.0, 2.0, 2.0]):  # surges at step 2 and again at 6
            _add_health(det, s, {"entropy": e}, warn=True)
        _add_health(SurgeDetector(patience=1), 0, {"entropy": 1.0}, warn=False)
    msgs = [r.getMessage() for r in caplog.records if "surge" in r.getMessage()]
    assert msgs == ["step 2: entropy surge since step 1: entropy 2 is 100% above the run's minimum 1"]
