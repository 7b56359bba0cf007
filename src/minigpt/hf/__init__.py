"""Hugging Face transformers interop: export a run as a transformers checkpoint, import one as a run.

By job: `architecture` (which transformers class computes a minigpt model, and the tensor map both ways),
`export` (run -> checkpoint folder), `import_` (checkpoint folder -> run), `weights` (the safetensors
reader) and `tokenizer` (tokenizer files both ways).
"""

from minigpt.hf.architecture import APERTUS, GPT2, LLAMA, QWEN2, QWEN3, hf_architecture
from minigpt.hf.export import export_hf, gather_params, hf_config, hf_tensors, write_hf
from minigpt.hf.import_ import import_hf, minigpt_arrays, model_config_from_hf, train_command

__all__ = [
    "APERTUS",
    "GPT2",
    "LLAMA",
    "QWEN2",
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
