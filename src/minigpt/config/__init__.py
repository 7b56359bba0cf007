"""Run configuration: the schema (frozen dataclasses tyro turns into flags), the named presets, and the JSON
codec a run directory's config.json is written and read with. Importers use `from minigpt.config import X`."""

from minigpt.config.codec import (
    config_changes,
    from_dict,
    load_json,
    save_json,
    subcommand_name,
    to_dict,
)
from minigpt.config.lora import LoRAConfig
from minigpt.config.presets import PRESETS, get_preset
from minigpt.config.schema import (
    REMAT_POLICIES,
    WANDB_MODES,
    DataConfig,
    DistributedConfig,
    MeshConfig,
    ModelConfig,
    Source,
    TrainConfig,
    WandbConfig,
    is_resume_safe,
    parse_steps_window,
    resume_safe,
    split_names,
)
from minigpt.errors import ConfigError

__all__ = [
    "PRESETS",
    "REMAT_POLICIES",
    "WANDB_MODES",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoRAConfig",
    "MeshConfig",
    "ModelConfig",
    "Source",
    "TrainConfig",
    "WandbConfig",
    "config_changes",
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
