"""The whole run configuration: one typed section per field, in the order a YAML recipe lists them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.config.calib import CalibConfig
from megatron_rl.config.checkpoint import CheckpointConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.eval import EvalConfig
from megatron_rl.config.health import HealthConfig
from megatron_rl.config.log import LogConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.sync import SyncConfig
from megatron_rl.config.train import TrainConfig


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    calib: CalibConfig = field(default_factory=CalibConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
