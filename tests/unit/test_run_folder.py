"""What a launch does with a log folder (loop/run_folder.py), on folders written by hand: start,
resume, refuse naming the differing keys, overwrite; and the checkpoint.resume / overwrite knobs."""

from __future__ import annotations

import pytest

from megatron_rl.config import load_config, save_config
from megatron_rl.loop import run_folder


def _cfg(log_dir, *overrides: str):
    return load_config(None, [f"log.dir={log_dir}", *overrides])


def _saved_run(log_dir, *overrides: str, latest: int | None = 4):
    """A folder as a run leaves it: config.yaml of `overrides`, metrics, and checkpoint `latest`."""
    log_dir.mkdir(parents=True)
    save_config(_cfg(log_dir, *overrides), log_dir / "config.yaml")
    (log_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    if latest is not None:
        (log_dir / "checkpoints" / f"step_{latest:06d}").mkdir(parents=True)
        (log_dir / "checkpoints" / "latest").write_text(str(latest))
    return log_dir


def test_resume_defaults_to_auto_and_takes_true_false_or_auto():
    assert load_config(None).checkpoint.resume == "auto"
    assert load_config(None, ["checkpoint.resume=true"]).checkpoint.resume is True
    assert load_config(None, ["checkpoint.resume=false"]).checkpoint.resume is False
    with pytest.raises(ValueError, match=r"config key 'checkpoint.resume': expected auto, true or false, got 'maybe'"):
        load_config(None, ["checkpoint.resume=maybe"])
    with pytest.raises(ValueError, match=r"config key 'checkpoint.overwrite'"):
        load_config(None, ["checkpoint.resume=true", "checkpoint.overwrite=true"])


@pytest.mark.parametrize("resume", ["auto", "false", "true"])
def test_an_empty_or_missing_folder_starts_a_run(tmp_path, resume):
    for log_dir in (tmp_path / "absent", tmp_path):  # tmp_path exists, empty
        assert run_folder.decide(_cfg(log_dir, f"checkpoint.resume={resume}")) == "start"


def test_a_compatible_run_resumes_whatever_else_changed(tmp_path):
    log_dir = _saved_run(tmp_path / "run", "precision.train_recipe=blockwise", "train.num_steps=4")
    later = _cfg(log_dir, "precision.train_recipe=blockwise", "train.num_steps=80", "train.lr=3e-5",
                 "eval.every=5", "checkpoint.resume=true")
    assert run_folder.decide(later) == "resume"
    resolved = run_folder.prepare_log_dir(_cfg(log_dir, "precision.train_recipe=blockwise"), rank=0)
    assert resolved.checkpoint.resume is True and (log_dir / "config.yaml").exists()


def test_a_run_without_a_checkpoint_restarts_in_place(tmp_path):
    log_dir = _saved_run(tmp_path / "run", latest=None)
    for resume in ("auto", "true"):  # from step 0: build_run finds no checkpoint
        assert run_folder.decide(_cfg(log_dir, f"checkpoint.resume={resume}")) == "resume"


@pytest.mark.parametrize("overrides, named", [
    (["precision.train_recipe=bf16", "precision.rollout_quant=bf16", "calib.enabled=false"],
     ["calib.enabled: true -> false", 'precision.rollout_quant: "fp8_blockwise" -> "bf16"', 'precision.train_recipe: "blockwise" -> "bf16"']),
    (["model.tiny_hidden_size=256"], ["model.tiny_hidden_size: 64 -> 256"]),
    (["data.task=add"], ['data.task: "sort" -> "add"']),
    (["calib.enabled=false"], ["calib.enabled: true -> false"]),
    (["algo.loss_mode=gspo", "calib.level=sequence"], ['algo.loss_mode: "vanilla" -> "gspo"']),
])
def test_another_run_is_refused_naming_every_key_that_differs(tmp_path, overrides, named):
    base = ["precision.train_recipe=blockwise", "precision.rollout_quant=fp8_blockwise", "calib.enabled=true",
            "model.tiny_hidden_size=64"]
    log_dir = _saved_run(tmp_path / "run", *base)
    before = (log_dir / "config.yaml").read_text()
    with pytest.raises(ValueError) as err:
        run_folder.prepare_log_dir(_cfg(log_dir, *base, *overrides), rank=0)
    message = str(err.value)
    assert message.startswith(f"log.dir {log_dir} holds another run") and "--overwrite" in message
    differing = message.split("differs: ")[1].split(")")[0].split("; ")
    assert differing == named
    assert (log_dir / "config.yaml").read_text() == before


def test_resume_false_refuses_a_folder_that_holds_a_run(tmp_path):
    log_dir = _saved_run(tmp_path / "run")
    with pytest.raises(ValueError, match=r"'checkpoint.resume': false, but log.dir .* holds a run; pass --overwrite"):
        run_folder.decide(_cfg(log_dir, "checkpoint.resume=false"))
    (log_dir / "config.yaml").unlink()  # metrics alone mark a run too
    with pytest.raises(ValueError, match="holds a run"):
        run_folder.decide(_cfg(log_dir, "checkpoint.resume=false"))


def test_overwrite_deletes_the_run_files_and_nothing_else(tmp_path):
    log_dir = _saved_run(tmp_path / "run", "precision.train_recipe=bf16", "precision.rollout_quant=bf16")
    for name in ("best", "best.json"):
        (log_dir / "checkpoints" / name).write_text("4")
    (log_dir / "samples").mkdir()
    (log_dir / "notes.md").write_text("mine")
    (log_dir / ".overwritten_1_2" / "checkpoints").mkdir(parents=True)  # left by a killed overwrite
    cfg = run_folder.prepare_log_dir(_cfg(log_dir, "checkpoint.overwrite=true"), rank=0)
    assert (cfg.checkpoint.resume, cfg.checkpoint.overwrite) == (False, False)
    assert sorted(p.name for p in log_dir.iterdir()) == ["notes.md"]


def test_other_ranks_decide_but_never_delete(tmp_path):
    log_dir = _saved_run(tmp_path / "run")
    cfg = run_folder.prepare_log_dir(_cfg(log_dir, "checkpoint.overwrite=true"), rank=1)
    assert cfg.checkpoint.resume is False and (log_dir / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("resume", ["auto", "false"])
@pytest.mark.parametrize("same_config", [True, False])
def test_overwrite_wins_over_every_resume_setting_and_any_saved_config(tmp_path, resume, same_config):
    """checkpoint.overwrite crossed with checkpoint.resume (true and overwrite are refused at load)
    and with a saved config that matches or not: overwrite always overwrites; without it, false
    refuses, auto resumes the same run and refuses another."""
    log_dir = _saved_run(tmp_path / "run", "train.num_steps=4")
    other = [] if same_config else ["precision.train_recipe=tensorwise"]
    assert run_folder.decide(_cfg(log_dir, "train.num_steps=4", f"checkpoint.resume={resume}",
                                  "checkpoint.overwrite=true", *other)) == "overwrite"
    plain = _cfg(log_dir, "train.num_steps=4", f"checkpoint.resume={resume}", *other)
    if resume == "auto" and same_config:
        assert run_folder.decide(plain) == "resume"
    else:
        with pytest.raises(ValueError, match="resume': false|holds another run"):
            run_folder.decide(plain)
