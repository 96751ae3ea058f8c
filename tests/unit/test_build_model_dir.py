"""Where a run's model comes from: the user's HF folder (refused by name without a config.json), else
the tiny warm-started model."""

from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.loop.build import build_model_dir


def test_the_users_hf_folder_is_used_as_it_is(qwen2_dir, tmp_path):
    one_rank = SimpleNamespace(rank=0)
    assert build_model_dir(load_config(None, [f"model.hf_dir={qwen2_dir}"]), one_rank) == qwen2_dir
    with pytest.raises(ValueError) as err:
        build_model_dir(load_config(None, [f"model.hf_dir={tmp_path}"]), one_rank)
    assert str(err.value) == f"config key 'model.hf_dir': no HF checkpoint (config.json) in {tmp_path}"
