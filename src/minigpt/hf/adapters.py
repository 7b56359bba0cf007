"""A LoRA run's adapters as a PEFT adapter folder (`minigpt export --adapters`): adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained` loads onto the checkpoint the run started
from. PEFT's LoRA computes what minigpt's does: W x + lora_alpha / r * B A x, with A (r, in) and B (out, r) the
transposes of minigpt's (in, r) and (r, out)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from minigpt.config import ConfigError, LoRAConfig, ModelConfig
from minigpt.hf.architecture import GPT2, hf_architecture, tensor_table
from minigpt.hf.export import gather_params
from minigpt.nn import lora
from minigpt.runtime import files
from minigpt.training.runs import check_output, load_model, run_config

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_tensors(cfg: ModelConfig, named: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """PEFT's state dict of the adapters among `named` (dotted minigpt names, layers unstacked), and the
    LoraConfig fields that say where they go: target_modules, and for GPT-2 the Conv1D layout and the rank
    and alpha of its c_attn (`_fused`)."""
    arch = hf_architecture(dataclasses.replace(cfg, lora=LoRAConfig()))
    tensors, targets, fields = {}, set(), {"fan_in_fan_out": arch == GPT2}
    for hf, ours, _ in tensor_table(cfg, arch):
        owners = [o.removesuffix("kernel") + "adapter.lora." for o in ours]
        present = [o for o in owners if o + lora.A in named]
        if not hf.endswith(".weight") or not present:
            continue
        module = f"base_model.model.{hf.removesuffix('.weight')}"
        if len(owners) == 1:
            a, b = named[present[0] + lora.A].T, named[present[0] + lora.B].T
        else:
            (a, b), n = _fused(named, owners, present), len(present)
            pattern = module.split(".")[-1]
            fields |= {
                "rank_pattern": {pattern: n * cfg.lora.rank},
                "alpha_pattern": {pattern: n * cfg.lora.alpha},
            }
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
        targets.add(".".join(module.split(".")[-2:]) if arch == GPT2 else module.rsplit(".", 1)[1])
    return tensors, {"target_modules": sorted(targets), **fields}


def _fused(
    named: dict[str, np.ndarray], owners: list[str], present: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """One adapter for GPT-2's c_attn (q, k and v in one projection, `owners`) computing what the adapted
    ones' (`present`) do: A stacks their A's, B places each B at its projection's outputs, so B A is
    block-diagonal. With n of them adapted its rank is n r, and alpha n alpha keeps the scale alpha / r."""
    widths = [named[o.removesuffix("adapter.lora.") + "kernel"].shape[1] for o in owners]
    starts = np.cumsum([0, *widths])
    rank = named[present[0] + lora.A].shape[1]
    a = np.concatenate([named[o + lora.A].T for o in present])
    b = np.zeros((starts[-1], rank * len(present)), np.float32)
    for j, o in enumerate(present):
        i = owners.index(o)
        b[starts[i] : starts[i + 1], j * rank : (j + 1) * rank] = named[o + lora.B].T
    return a, b


def peft_config(cfg: LoRAConfig, placement: dict, base: str | None) -> dict:
    """adapter_config.json: PEFT's LoraConfig of these adapters (`peft_tensors`'s placement), naming the
    base checkpoint."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout, "bias": "none", "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base, **placement,
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
    tensors, placement = peft_tensors(setup.cfg.model, gather_params(params, setup.cfg.model))
    base = str(Path(cfg.init_from).absolute()) if cfg.init_from else None
    write_peft(out, tensors, peft_config(cfg.model.lora, placement, base))
    return out


def write_peft(out: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    from safetensors.numpy import save_file

    with files.atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
