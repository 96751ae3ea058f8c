"""Recipes that compose (`base:`), list items overridden by index, `megatron-rl config` and its round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_rl.cli import main
from megatron_rl.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = [(m, v) for m in ("qwen3_8b_grpo", "qwen3_14b_dapo", "qwen25_32b_grpo")
               for v in ("bf16", "fp8", "fp8_calibrated")]
# Verbatim copies of the GPU recipes before they were rewritten on a shared base (commit 11d358a).
BEFORE_BASE = ROOT / "tests" / "data" / "recipes" / "before_base"


def _leaves(obj, prefix=""):
    """{dotted key: value} of every field, recursing into sections (not into lists)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            out.update(_leaves(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix[:-1]: obj}


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("model, variant", GPU_RECIPES)
def test_gpu_recipe_on_its_base_resolves_to_the_old_recipe_field_by_field(model, variant):
    old = _leaves(load_config(BEFORE_BASE / model / f"{variant}.yaml"))
    new = _leaves(load_config(ROOT / "examples" / model / f"{variant}.yaml"))
    assert set(old) == set(new)
    differ = {k: (old[k], new[k]) for k in old if old[k] != new[k] or type(old[k]) is not type(new[k])}
    assert not differ
    assert len(old) > 150  # every field compared, nested sections and lists included


@pytest.mark.parametrize("model", ["qwen3_8b_grpo", "qwen3_14b_dapo", "qwen25_32b_grpo"])
def test_gpu_variants_are_small_overrides_of_one_base(model):
    folder = ROOT / "examples" / model
    bases = {v: yaml.safe_load((folder / f"{v}.yaml").read_text())["base"] for v in ("bf16", "fp8", "fp8_calibrated")}
    assert bases == {"bf16": "base.yaml", "fp8": "base.yaml", "fp8_calibrated": "fp8.yaml"}
    for v in ("bf16", "fp8", "fp8_calibrated"):
        lines = [l for l in (folder / f"{v}.yaml").read_text().splitlines() if l.strip() and not l.startswith("#")]
        assert len(lines) <= 12, (v, lines)


def test_base_chain_merges_mappings_at_every_depth_and_replaces_lists(tmp_path):
    _write(tmp_path, "common/root.yaml", """
train: {num_steps: 11, lr: 2.0e-6, seed: 7}
rollout:
  stop: ["</a>", "</b>"]
  sglang: {tp_size: 2, mem_fraction_static: 0.5}
data: {template_kwargs: {enable_thinking: false, x: 1}}
eval:
  datasets:
    - {name: one, task: sort}
    - {name: two, task: add}
""")
    _write(tmp_path, "common/mid.yaml", """
base: root.yaml
train: {num_steps: 22}
rollout:
  sglang: {mem_fraction_static: 0.7}
data: {template_kwargs: {x: 2}}
""")
    leaf = _write(tmp_path, "variants/leaf.yaml", """
base: ../common/mid.yaml
train: {seed: 9}
rollout: {stop: ["</c>"]}
eval:
  datasets:
    - {name: three, task: reverse}
""")
    cfg = load_config(leaf)
    assert (cfg.train.num_steps, cfg.train.lr, cfg.train.seed) == (22, 2.0e-6, 9)  # root < mid < leaf
    assert (cfg.rollout.sglang.tp_size, cfg.rollout.sglang.mem_fraction_static) == (2, 0.7)
    assert cfg.data.template_kwargs == {"enable_thinking": False, "x": 2}
    assert cfg.rollout.stop == ["</c>"]  # a list is replaced, not appended
    assert [d.name for d in cfg.eval.datasets] == ["three"]
    assert cfg.train.micro_batch_size == RunConfig().train.micro_batch_size  # nobody set it: the default


def test_base_is_found_next_to_the_recipe_not_in_the_working_folder(tmp_path, monkeypatch):
    _write(tmp_path, "r/base.yaml", "train: {num_steps: 5}\n")
    recipe = _write(tmp_path, "r/run.yaml", "base: base.yaml\nalgo: {eps_clip_high: 0.28}\n")
    _write(tmp_path, "elsewhere/base.yaml", "train: {num_steps: 99}\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config(recipe)
    assert (cfg.train.num_steps, cfg.algo.eps_clip_high) == (5, 0.28)


@pytest.mark.parametrize("files, chain", [
    ({"a.yaml": "base: a.yaml\n"}, ["a.yaml", "a.yaml"]),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: c.yaml\n", "c.yaml": "base: b.yaml\n"},
     ["a.yaml", "b.yaml", "c.yaml", "b.yaml"]),
])
def test_a_base_cycle_is_refused_naming_the_chain(tmp_path, files, chain):
    for name, text in files.items():
        _write(tmp_path, name, text)
    with pytest.raises(ValueError, match="base") as err:
        load_config(tmp_path / "a.yaml")
    names = [Path(p.strip()).name for p in str(err.value).split(": ")[-1].split("->")]
    assert names == chain


def test_a_missing_or_malformed_base_is_named(tmp_path):
    recipe = _write(tmp_path, "run.yaml", "base: absent.yaml\n")
    with pytest.raises(ValueError, match=r"not found: .*absent\.yaml \(the base of .*run\.yaml\)"):
        load_config(recipe)
    for bad in ("base: [a.yaml]\n", "base: ''\n", "base: null\n"):
        recipe.write_text(bad)
        with pytest.raises(ValueError, match=r"run\.yaml: `base:` must be the path of a recipe"):
            load_config(recipe)
    _write(tmp_path, "b.yaml", "train: {nope: 1}\n")
    recipe.write_text("base: b.yaml\n")
    with pytest.raises(ValueError, match=r"unknown config key 'train\.nope'"):
        load_config(recipe)


EVAL_TWO = ['eval.datasets=[{name: a, task: sort}, {name: b, task: add, temperature: 0.3}]']


def test_list_items_are_overridden_by_index():
    cfg = load_config(None, EVAL_TWO + ["eval.datasets.1.temperature=0.6", "eval.datasets.0.n_samples=4",
                                        "rollout.stop=[x, y, z]", "rollout.stop.1=</answer>"])
    a, b = cfg.eval.datasets
    assert (a.name, a.temperature, a.n_samples, a.task) == ("a", 0.0, 4, "sort")
    assert (b.name, b.temperature, b.n_samples, b.task) == ("b", 0.6, 1, "add")
    assert cfg.rollout.stop == ["x", "</answer>", "z"]
    cfg = load_config(None, EVAL_TWO + ["eval.datasets.1={name: c, path: p.jsonl}"])  # a whole item
    assert [(d.name, d.path, d.task) for d in cfg.eval.datasets] == [("a", "", "sort"), ("c", "p.jsonl", "")]


@pytest.mark.parametrize("override, message", [
    ("eval.datasets.2.temperature=0.6", r"'eval\.datasets\.2': index 2 is out of range, eval\.datasets has 2 item"),
    ("eval.datasets.-1.temperature=0.6", r"'eval\.datasets\.-1': eval\.datasets is a list; expected an index 0\.\.1"),
    ("eval.datasets.first.temperature=0.6", r"'eval\.datasets\.first': eval\.datasets is a list"),
    ("eval.datasets.1.temp=0.6", r"unknown config key 'eval\.datasets\[1\]\.temp'"),
    ("eval.datasets.1.n_samples=many", r"config key 'eval\.datasets\[1\]\.n_samples': expected int"),
    ("rollout.stop.0=x", r"'rollout\.stop\.0': index 0 is out of range, rollout\.stop has 0 item"),
])
def test_a_bad_index_or_item_key_is_one_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, EVAL_TWO + [override])


def test_index_override_of_a_scalar_list_checks_the_element_type():
    cfg = load_config(None, ["rollout.stop_token_ids=[1, 2]", "rollout.stop_token_ids.1=7"])
    assert cfg.rollout.stop_token_ids == [1, 7]
    with pytest.raises(ValueError, match=r"'rollout\.stop_token_ids\[1\]': expected int"):
        load_config(None, ["rollout.stop_token_ids=[1, 2]", "rollout.stop_token_ids.1=seven"])


def _field_names(tp, prefix=""):
    """Every dotted field of the dataclass type tp, from its declaration (not from a config's values)."""
    out = set()
    for f in dataclasses.fields(tp):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= _field_names(type(default), f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def _yaml_keys(node: dict, section, prefix=""):
    """Dotted keys of a printed config, recursing where the config has a section (not into dict values)."""
    out = set()
    for key, value in node.items():
        child = getattr(section, key, None)
        if dataclasses.is_dataclass(child):
            out |= _yaml_keys(value, child, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


@pytest.mark.parametrize("recipe, overrides", [
    ("examples/qwen3_14b_dapo/fp8_calibrated.yaml", ["eval.datasets.2.temperature=0.6", "train.lr=3e-7"]),
    ("examples/qwen3_8b_grpo/bf16.yaml", ["data.template_kwargs={enable_thinking: false}", "algo.eps_clip_c=3",
                                          "rollout.stop=['</answer>']", "calib.init_low=0.75"]),
    ("examples/tiny/fp8_calibrated.yaml", []),
])
def test_config_command_prints_every_field_and_loads_back_to_the_same_config(recipe, overrides, tmp_path, capsys):
    assert main(["config", str(ROOT / recipe), *overrides]) == 0
    printed = capsys.readouterr().out
    assert _yaml_keys(yaml.safe_load(printed), RunConfig()) == _field_names(RunConfig)  # defaults included
    saved = _write(tmp_path, "resolved.yaml", printed)
    again = load_config(saved)
    assert again == load_config(ROOT / recipe, overrides)
    assert _leaves(again) == _leaves(load_config(ROOT / recipe, overrides))


def test_config_command_reports_a_bad_override(capsys):
    assert main(["config", str(ROOT / "examples/qwen3_8b_grpo/fp8.yaml"), "eval.datasets.3.n_samples=2"]) == 2
    assert "index 3 is out of range, eval.datasets has 3 item(s)" in capsys.readouterr().err
