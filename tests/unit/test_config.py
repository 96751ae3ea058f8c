"""Config: YAML + overrides, and one clear ValueError naming the bad key."""

import pytest

from megatron_rl.config import load_config, parse_override
from megatron_rl.cli import main


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  eps_clip_high: 0.28\ntrain:\n  num_steps: 7\n")
    cfg = load_config(path, ["train.num_steps=3", "precision.weight_block_size=[64, 64]"])
    assert cfg.algo.eps_clip_high == 0.28
    assert cfg.train.num_steps == 3  # override wins over the file
    assert cfg.precision.weight_block_size == [64, 64]
    assert cfg.algo.eps_clip == 0.2  # untouched default


def test_int_is_accepted_for_float_and_none_for_optional():
    cfg = load_config(None, ["train.lr=1", "algo.eps_clip_c=3", "algo.eps_clip_c=null"])
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0
    assert cfg.algo.eps_clip_c is None


@pytest.mark.parametrize("override, named", [
    ("algo.eps_clipp=0.1", "algo.eps_clipp"),
    ("nosection.key=1", "nosection"),
    ("train.num_steps=many", "train.num_steps"),
    ("train.num_steps=1.5", "train.num_steps"),
    ("precision.train_recipe=fp4", "precision.train_recipe"),
    ("algo.eps_clip_c=0.5", "algo.eps_clip_c"),
    ("algo.eps_clip=1.5", "algo.eps_clip"),
    ("rollout.n_samples_per_prompt=1", "rollout.n_samples_per_prompt"),
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("calib.enabled=yes please", "calib.enabled"),
    ("precision.weight_block_size=[128]", "precision.weight_block_size"),
    ("model.outlier_channels=-1", "model.outlier_channels"),
    ("model.outlier_channels=129", "model.outlier_channels"),  # tiny_hidden_size is 128
    ("model.outlier_scale=0.5", "model.outlier_scale"),
])
def test_bad_value_names_the_key(override, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_calibration_needs_an_fp8_recipe():
    with pytest.raises(ValueError, match="calib.enabled"):
        load_config(None, ["calib.enabled=true"])
    cfg = load_config(None, ["calib.enabled=true", "precision.train_recipe=blockwise"])
    assert cfg.calib.enabled


def test_override_syntax():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    with pytest.raises(ValueError, match="section.key=value"):
        parse_override("novalue")


def test_missing_config_file_and_cli_exit_code(tmp_path, capsys):
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    assert main(["train", str(tmp_path / "absent.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "megatron-rl train" in capsys.readouterr().out


def test_fp4_recipes_and_rollout_quant():
    cfg = load_config(None, ["precision.train_recipe=nvfp4", "precision.rollout_quant=mxfp4"])
    assert (cfg.precision.train_recipe, cfg.precision.rollout_quant) == ("nvfp4", "mxfp4")
    load_config(None, ["precision.train_recipe=mxfp4", "precision.fp8_format=e4m3"])  # ignored, valid
    with pytest.raises(ValueError, match="precision.train_recipe"):
        load_config(None, ["precision.train_recipe=fp4"])
    with pytest.raises(ValueError, match="precision.rollout_quant.*'nvfp4'.*torch rollout engine only"):
        load_config(None, ["rollout.engine=sglang", "precision.rollout_quant=nvfp4"])
