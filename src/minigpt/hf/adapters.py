"""A LoRA run's adapters as a PEFT adapter folder (`minigpt export --adapters`): adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained` loads onto the checkpoint the run started
from. PEFT's LoRA computes what minigpt's does: W x + lora_alpha / r * B A x, with A (r, in) and B (out, r) the
transposes of minigpt's (in, r) and (r, out)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from minigpt import files, lora
from minigpt.config import ConfigError, LoRAConfig, ModelConfig
from minigpt.hf.architecture import GPT2, hf_architecture, tensor_table
from minigpt.hf.export import gather_params
from minigpt.training.runs import check_output, load_model, run_config

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_tensors(cfg: ModelConfig, named: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """PEFT's state dict of the adapters among `named` (dotted minigpt names, layers unstacked), and the
    projections they target (q_proj, ...). A GPT-2 model has none PEFT could load: its q, k and v are one
    tensor in transformers."""
    arch = hf_architecture(dataclasses.replace(cfg, lora=LoRAConfig()))
    if arch == GPT2:
        raise ConfigError(
            "GPT-2's q, k and v are one tensor in transformers, so its adapters have no PEFT form; export the "
            "merged model with --format hf instead"
        )
    tensors, targets = {}, set()
    for hf, ours, _ in tensor_table(cfg, arch):
        owner = ours[0].removesuffix("kernel") + "adapter.lora."
        if not hf.endswith(".weight") or owner + lora.A not in named:
            continue
        module = f"base_model.model.{hf.removesuffix('.weight')}"
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(named[owner + lora.A].T, np.float32)
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(named[owner + lora.B].T, np.float32)
        targets.add(module.rsplit(".", 1)[1])
    return tensors, sorted(targets)


def peft_config(cfg: LoRAConfig, targets: list[str], base: str | None) -> dict:
    """adapter_config.json: PEFT's LoraConfig of these adapters, naming the base checkpoint."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base,
    }  # fmt: skip


def export_adapters(run: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """`minigpt export --adapters`: the newest checkpoint's adapters of a LoRA run as a PEFT folder."""
    run, out = Path(run), Path(out)
    check_output(out, run, overwrite, "PEFT adapter folder")
    cfg = run_config(run)
    if not cfg.model.lora.rank:
        raise ConfigError(
            f"{run} has no adapters (it trained without --lora.rank); export it with --format hf"
        )
    setup, params, _, _ = load_model(run)
    tensors, targets = peft_tensors(setup.cfg.model, gather_params(params, setup.cfg.model))
    base = str(Path(cfg.init_from).absolute()) if cfg.init_from else None
    write_peft(out, tensors, peft_config(cfg.model.lora, targets, base))
    return out


def write_peft(out: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    from safetensors.numpy import save_file

    with files.atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
