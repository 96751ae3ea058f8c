"""The CLI: options and overrides in any order after CONFIG, `--help` lists every subcommand on one
line, and `plan` refuses a model that does not split over TP / PP with the actor's own message."""

import json
from pathlib import Path

import pytest

from megatron_rl.cli import build_parser, main, parse_args
from megatron_rl.models.hf_config import ModelSpec, transformer_config_kwargs

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


@pytest.mark.parametrize("argv", [
    ["train", "c.yaml", "--resume", "a.b=1", "c.d=2"],
    ["train", "c.yaml", "a.b=1", "--resume", "c.d=2"],
    ["train", "c.yaml", "a.b=1", "c.d=2", "--resume"],
    ["train", "--resume", "c.yaml", "a.b=1", "c.d=2"],
])
def test_train_any_order(argv):
    args = parse_args(argv)
    assert (args.command, args.config, args.overrides, args.resume) == ("train", "c.yaml", ["a.b=1", "c.d=2"], True)


@pytest.mark.parametrize("argv", [
    ["plan", "c.yaml", "--nodes", "4", "a.b=1", "--json"],
    ["plan", "c.yaml", "a.b=1", "--nodes", "4", "--json"],
    ["plan", "--nodes", "4", "--json", "c.yaml", "a.b=1"],
    ["plan", "--json", "c.yaml", "--nodes=4", "a.b=1"],
])
def test_plan_any_order(argv):
    args = parse_args(argv)
    assert (args.command, args.config, args.overrides, args.nodes, args.json) == ("plan", "c.yaml", ["a.b=1"], 4, True)
    assert parse_args(["train", "c.yaml"]).overrides == [] and not parse_args(["train", "c.yaml"]).resume


def test_help_lists_every_subcommand_on_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    names = list(sub.choices)
    assert {"train", "plan", "launch"} <= set(names)
    lines = out.splitlines()
    for name in names:
        (line,) = [l for l in lines if l.strip().startswith(name + " ")]  # noqa: E741
        assert len(line.split(None, 1)) == 2  # name and its one-line help
        following = lines[lines.index(line) + 1]
        assert not following.startswith(" " * 20), f"help of {name!r} wraps onto a second line"


def test_unknown_option_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "c.yaml", "--nodes", "2"])
    assert "unrecognized arguments: --nodes" in capsys.readouterr().err


@pytest.mark.parametrize("tp,pp,message", [
    (16, 1, "num_key_value_heads=8 is not divisible by tensor_model_parallel_size=16"),
    (3, 1, "num_key_value_heads=8 is not divisible by tensor_model_parallel_size=3"),
    (1, 5, "num_layers=36 is not divisible by pipeline_model_parallel_size=5"),
])
def test_plan_refuses_what_the_actor_refuses(tmp_path, capsys, tp, pp, message):
    spec = ModelSpec.from_hf_config(DATA / "qwen3_8b.json")
    with pytest.raises(ValueError) as actor_error:
        transformer_config_kwargs(spec, tp=tp, pp=pp)
    assert str(actor_error.value) == message  # Qwen3-8B: 32 heads, 8 KV heads, 36 layers
    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  engine: torch\n")
    code = main(["plan", str(config), f"parallel.tensor_model_parallel_size={tp}", "--hf-config",
                 str(DATA / "qwen3_8b.json"), f"parallel.pipeline_model_parallel_size={pp}", "--nodes", "4"])
    assert code == 2 and capsys.readouterr().err.strip() == f"megatron-rl: error: {message}"


def test_kv_heads_vocab_and_ffn_checks():
    spec = ModelSpec.from_hf_config(json.loads((DATA / "qwen3_8b.json").read_text()))
    assert spec.num_query_groups == 8
    with pytest.raises(ValueError, match="num_attention_heads=36 is not divisible by tensor_model_parallel_size=8"):
        transformer_config_kwargs(ModelSpec(**{**spec.__dict__, "num_attention_heads": 36}), tp=8)
    with pytest.raises(ValueError, match="vocab_size=151937 is not divisible"):
        transformer_config_kwargs(ModelSpec(**{**spec.__dict__, "vocab_size": 151937}), tp=2)
    with pytest.raises(ValueError, match="intermediate_size=12289 is not divisible"):
        transformer_config_kwargs(ModelSpec(**{**spec.__dict__, "ffn_hidden_size": 12289}), tp=2)
