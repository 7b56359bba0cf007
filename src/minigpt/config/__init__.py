"""Run configuration: the schema by section (model, data, run, training, sampling, evaluation: frozen dataclasses
tyro turns into flags), the named presets, and the JSON codec a run directory's config.json is written and read with. Importers use `from minigpt.config import X`."""

from minigpt.config.codec import (
    config_changes,
    config_differences,
    from_dict,
    load_json,
    save_json,
    subcommand_name,
    to_dict,
)
from minigpt.config.data import DataConfig, Source
from minigpt.config.evaluation import EvalConfig
from minigpt.config.fields import is_resume_safe, resume_safe
from minigpt.config.lora import LoRAConfig
from minigpt.config.model import REMAT_POLICIES, ModelConfig
from minigpt.config.presets import PRESETS, get_preset
from minigpt.config.run import WANDB_MODES, DistributedConfig, MeshConfig, WandbConfig
from minigpt.config.sampling import SamplingConfig
from minigpt.config.training import TrainConfig, parse_steps_window, split_names
from minigpt.runtime.errors import ConfigError

__all__ = [
    "PRESETS",
    "REMAT_POLICIES",
    "WANDB_MODES",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "LoRAConfig",
    "MeshConfig",
    "ModelConfig",
    "SamplingConfig",
    "Source",
    "TrainConfig",
    "WandbConfig",
    "config_changes",
    "config_differences",
    "from_dict",
    "get_preset",
    "is_resume_safe",
    "load_json",
    "parse_steps_window",
    "resume_safe",
    "save_json",
    "split_names",
    "subcommand_name",
    "to_dict",
]
