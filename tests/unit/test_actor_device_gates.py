"""Build-time gates on a (pretend) GPU: TE required, its environment first, the recipe against
the device; the megatron-core version range; the quiet start."""

import logging
import warnings

import pytest
import torch

from megatron_rl.actor import megatron_compat
from megatron_rl.loop.build import build_actor_settings
from megatron_rl.config import load_config
from megatron_rl.fp8 import te_recipe


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA machine with compute capability 9.0 (H100/H200), as far as the build can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


def test_missing_te_on_cuda_is_refused_not_a_fallback(hopper, monkeypatch):
    monkeypatch.setattr(te_recipe, "te_available", lambda: False)
    with pytest.raises(ValueError, match="transformer_engine does not import.*transformer_impl=local"):
        build_actor_settings(load_config(None, []))
    local = build_actor_settings(load_config(None, ["parallel.transformer_impl=local"]))
    assert local.transformer_impl == "local" and local.params_dtype == "bf16"


def test_mxfp8_on_hopper_is_refused(hopper, monkeypatch):
    monkeypatch.setattr(te_recipe, "te_available", lambda: True)
    with pytest.raises(ValueError, match="Blackwell.*9.0"):
        build_actor_settings(load_config(None, ["precision.train_recipe=mxfp8"]))


def test_block_scaling_environment_checked_before_te(hopper, monkeypatch):
    imported = []
    monkeypatch.setattr(te_recipe, "te_available", lambda: imported.append(1) or True)
    cfg = load_config(None, ["precision.train_recipe=blockwise"])
    with pytest.raises(ValueError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"):
        build_actor_settings(cfg)
    assert not imported  # refused before anything tried to import TE
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    settings = build_actor_settings(cfg)
    assert imported and settings.transformer_impl == "transformer_engine" and not settings.fp8_emulated


def test_rowwise_on_cuda_runs_emulated_and_says_so(hopper):
    settings = build_actor_settings(load_config(None, ["precision.train_recipe=rowwise"]))
    assert settings.fp8_emulated
    assert "fp8=rowwise(emulated)" in settings.summary("rowwise", 1)


@pytest.mark.parametrize("version, ok", [("0.16.1", True), ("0.16.4", True), ("0.16.0", False),
                                         ("0.17.0", False), ("0.19.0rc1", False)])
def test_megatron_core_version_range(version, ok):
    if ok:
        megatron_compat.check_megatron_version(version)
    else:
        with pytest.raises(RuntimeError, match=f"megatron-core {version} is untested.*<0.17"):
            megatron_compat.check_megatron_version(version)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_megatron_chatter_goes_to_debug():
    # What a root handler (the user's console or log file) receives. caplog would not do: pytest
    # also attaches its handler to every non-propagating logger, Megatron's included.
    from megatron_rl.actor.quiet import megatron_quiet

    root = logging.getLogger()
    seen, old_level = _Records(), root.level
    root.addHandler(seen)
    root.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as outside:
            warnings.simplefilter("always")
            with megatron_quiet():
                logging.getLogger("megatron.core.distributed").info("Params for bucket 1")
                logging.getLogger("megatron.core.optimizer").warning("real trouble")
                warnings.warn_explicit("Apex is not installed", UserWarning,
                                       "/x/megatron/core/models/backends.py", 21)
                warnings.warn("ours", UserWarning)
    finally:
        root.removeHandler(seen)
        root.setLevel(old_level)
    assert {r.name for r in seen.records} == {"megatron_rl.megatron"}
    levels = {r.getMessage().split(": ", 1)[-1]: r.levelno for r in seen.records}
    assert levels["Params for bucket 1"] == logging.DEBUG
    assert levels["real trouble"] == logging.WARNING
    assert any("Apex is not installed" in r.getMessage() and r.levelno == logging.DEBUG
               for r in seen.records)
    assert [str(w.message) for w in outside] == ["ours"]
