"""Run configuration: the ConfigDict defaults, loading with overrides, and the typed sections."""
from ._defaults import base_config
from ._load import ConfigError, load_config, load_config_dict, to_run_config, validate
from ._schema import (ActorConfig, AlgorithmConfig, AsyncTrainingConfig, ColocateAsyncConfig, CriticConfig, DataConfig,
                      FilterGroupsConfig, JudgeConfig, KLControlConfig, LoraConfig, MeshSection, ModelInitConfig,
                      ModelSection, MoeConfig, MultiTurnConfig, OptimConfig, OverlongBufferConfig, PlacementConfig,
                      RewardConfig, RewardModelConfig, RolloutConfig, RolloutCorrectionConfig, RouterReplayConfig,
                      RunConfig,
                      SamplerConfig, SamplingConfig, SeparateAsyncConfig, SFTConfig, TrainerConfig,
                      TrainerV1Config)
