"""Hugging Face transformers interop: export a run as a transformers checkpoint, import one as a run."""

from minigpt.hf.export import (
    APERTUS,
    GPT2,
    LLAMA,
    QWEN3,
    export_hf,
    gather_params,
    hf_architecture,
    hf_config,
    hf_tensors,
    import_hf,
    minigpt_arrays,
    model_config_from_hf,
    train_command,
    write_hf,
)

__all__ = [
    "APERTUS",
    "GPT2",
    "LLAMA",
    "QWEN3",
    "export_hf",
    "gather_params",
    "hf_architecture",
    "hf_config",
    "hf_tensors",
    "import_hf",
    "minigpt_arrays",
    "model_config_from_hf",
    "train_command",
    "write_hf",
]
