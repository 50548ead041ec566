"""Configuration: typed sections, YAML loading with overrides, validation."""

from .load import ConfigError, load_config
from .schema import (
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    VisionConfig,
)

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainingConfig",
    "VisionConfig",
    "load_config",
]
