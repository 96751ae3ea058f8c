"""Typed, nested run configuration: YAML recipes plus `section.key=value` overrides, validated at load.

One module per section, named after it (model.py for `model`, ...): its dataclass with every field
documented under it, CHOICES (field -> allowed values), POSITIVE (fields that must be > 0) and its
check_* functions. `run.py` composes the sections into RunConfig; `recipe.py` reads a YAML recipe and
its `base:` chain, `apply.py` applies a mapping or a dotted override with type checks, `load.py` ties
them together, and `validate.py` runs the tables and every check_* in a fixed order.
"""

from megatron_rl.config.algo import LOSS_AGG_MODES, AlgoConfig
from megatron_rl.config.calib import CalibConfig
from megatron_rl.config.checkpoint import CheckpointConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.eval import EVAL_PRECISIONS, EvalConfig, EvalDatasetConfig, eval_metric_names
from megatron_rl.config.health import HealthConfig
from megatron_rl.config.load import dump_config, load_config, parse_override, save_config
from megatron_rl.config.log import LogConfig, WandbConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.precision import FP4_ROLLOUT_QUANTS, ROLLOUT_QUANTS, TRAIN_RECIPES, PrecisionConfig
from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.rollout import RolloutConfig, SGLangConfig
from megatron_rl.config.run import RunConfig
from megatron_rl.config.sync import SyncConfig
from megatron_rl.config.train import TrainConfig
from megatron_rl.config.validate import validate

__all__ = [
    "AlgoConfig", "CalibConfig", "CheckpointConfig", "DataConfig", "EVAL_PRECISIONS", "EvalConfig",
    "EvalDatasetConfig", "FP4_ROLLOUT_QUANTS", "HealthConfig", "LOSS_AGG_MODES", "LogConfig", "ModelConfig",
    "ParallelConfig", "PrecisionConfig", "ROLLOUT_QUANTS", "RewardConfig", "RolloutConfig", "RunConfig",
    "SGLangConfig", "SyncConfig", "TRAIN_RECIPES", "TrainConfig", "WandbConfig", "dump_config", "eval_metric_names",
    "load_config", "parse_override", "save_config", "validate",
]
