"""The FLOPs model against XLA's own count, the convention's arithmetic, the peak-FLOPs table, and reading back a
metrics.jsonl that a killed run left torn."""

from __future__ import annotations

import dataclasses
import json
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from minigpt.config import DataConfig, ModelConfig, TrainConfig
from minigpt.corpus import DataWarning
from minigpt.metrics import (
    MetricsWriter,
    flops_per_step,
    flops_per_token,
    forward_flops_per_token,
    measure_matmul_flops,
    mfu,
    peak_flops_per_device,
    plot_losses,
    read_metrics,
    table_peak_flops,
)

# Three small shapes, each dominated by a different part of the model, so that the count of each part is
# checked: leaving a part out (or counting it twice) moves the total by more than the 10% tolerance.
SHAPES = {
    # name: (d_model, n_heads, d_ff, seq_len, vocab, batch, tied, the part that must carry > 25% of the FLOPs)
    "mlp-heavy": (256, 4, 1024, 64, 512, 4, True, "mlp"),
    "lm-head-heavy": (128, 2, 256, 32, 2048, 4, False, "lm_head"),
    "attention-heavy": (64, 2, 256, 256, 256, 2, True, "attention"),
}


def _config(d: int, heads: int, ff: int, seq: int, vocab: int, batch: int, tied: bool) -> TrainConfig:
    model = ModelConfig(vocab_size=vocab, max_seq_len=seq, d_model=d, n_layers=1, n_heads=heads, d_ff=ff,
                        tie_embeddings=tied)  # fmt: skip
    return TrainConfig(model=model, data=DataConfig(seq_len=seq), batch_size=batch, grad_accum=1)


@pytest.mark.parametrize("name", list(SHAPES))
def test_flops_model_agrees_with_xla_cost_analysis_of_the_train_step(name: str) -> None:
    """XLA's HloCostAnalysis of the compiled train step counts 2 flops per multiply-add in each dot, as we do,
    plus ~1 per element of every elementwise op (norms, GELU, softmax, the loss, AdamW's update) that our
    model-FLOPs convention leaves out: a few percent for these matmul-dominated shapes. Two differences are
    handled: XLA's CPU attention computes the whole T x T score matrix and then masks it, so we compare with
    `causal=False`; and it counts a loop body once whatever the trip count, so grad_accum is 1 (the
    accumulation `lax.scan` runs once)."""
    *shape, part = SHAPES[name]
    cfg = _config(*shape)
    _assert_matches_xla(cfg)
    parts = forward_flops_per_token(cfg.model, cfg.data.seq_len, causal=False)
    assert parts[part] / sum(parts.values()) > 0.25, parts  # the check above would notice this part missing


def _assert_matches_xla(cfg: TrainConfig) -> None:
    from minigpt.trainer import build, make_train_step

    setup = build(cfg, jax.devices()[:1])
    batch = jax.ShapeDtypeStruct((1, cfg.batch_size, cfg.data.seq_len + 1), jnp.int32)
    cost = make_train_step(setup).lower(setup.abstract_state, batch, cfg.steps).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ours = flops_per_step(cfg, causal=False)
    assert cost["flops"] / ours == pytest.approx(1.0, abs=0.10), (cost["flops"], ours)


def test_flops_model_counts_grouped_query_attention_and_swiglu() -> None:
    """Narrower k/v projections (2 of 8 heads) and SwiGLU's third matrix: each is ~15% of this model."""
    cfg = _config(256, 8, 768, 64, 512, 4, True)
    modern = {"n_kv_heads": 2, "activation": "swiglu", "position": "rope", "norm": "rmsnorm", "bias": False}
    _assert_matches_xla(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **modern)))


def test_flops_convention_for_gpt2_small_by_hand() -> None:
    """GPT-2 small, T=1024, vocab padded to 50304: per token and layer 2*(4*d^2 + 2*d*ff) for the weights and
    2*2*d*(T+1)/2 for causal attention, 2*d*V for the head, the embedding lookup nothing; training is 3x."""
    m = ModelConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072)
    assert m.padded_vocab == 50304
    forward = 12 * 2 * (4 * 768**2 + 2 * 768 * 3072) + 12 * 2 * 2 * 768 * 1025 / 2 + 2 * 768 * 50304
    assert flops_per_token(m, 1024) == pytest.approx(3 * forward)
    assert flops_per_token(m, 1024) == 798_087_168
    # The causal mask saves (T - 1) / 2 of the T keys per query in QK^T and AV, forward and backward.
    saved = flops_per_token(m, 1024, causal=False) - flops_per_token(m, 1024)
    assert saved == pytest.approx(3 * 12 * 2 * 2 * 768 * (1024 - 1025 / 2))
    cfg = TrainConfig(model=m, data=DataConfig(seq_len=1024), batch_size=64, grad_accum=8)
    assert flops_per_step(cfg) == pytest.approx(flops_per_token(m, 1024) * 64 * 8 * 1024)


@pytest.mark.parametrize(
    ("kind", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989),
        ("NVIDIA H100 80GB HBM3", "float32", 494),  # TF32 at JAX's default precision
        ("NVIDIA H100 PCIe", "bfloat16", 756),
        ("NVIDIA H100 NVL", "bfloat16", 835),
        ("NVIDIA H200", "bfloat16", 989),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312),
        ("NVIDIA A100 80GB PCIe", "float32", 156),
        ("NVIDIA A10", "bfloat16", 125),
        ("NVIDIA L4", "bfloat16", 121),
        ("NVIDIA L40S", "bfloat16", 362),
        ("TPU v4", "bfloat16", 275),
        ("TPU v5 lite", "bfloat16", 197),
        ("TPU v5e", "float32", 197),
        ("TPU v5", "bfloat16", 459),
        ("TPU v5p", "bfloat16", 459),
        ("TPU v6 lite", "bfloat16", 918),
    ],
)
def test_peak_table_matches_vendor_dense_figures(kind: str, dtype: str, tflops: float) -> None:
    assert table_peak_flops(kind, dtype) == pytest.approx(tflops * 1e12)


def test_peak_flops_full_float32_precision_unknown_devices_and_override() -> None:
    with jax.default_matmul_precision("float32"):
        assert table_peak_flops("NVIDIA H100 80GB HBM3", "float32") == pytest.approx(67e12)
        assert table_peak_flops("NVIDIA A100-SXM4-40GB", "float32") == pytest.approx(19.5e12)
    assert table_peak_flops("Some Future Accelerator", "bfloat16") is None
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert peak_flops_per_device(gpu, "bfloat16") == pytest.approx(989e12)
    assert peak_flops_per_device(gpu, "bfloat16", peak_tflops=100.0) == pytest.approx(100e12)
    unknown = types.SimpleNamespace(platform="gpu", device_kind="Mystery GPU")
    assert peak_flops_per_device(unknown, "bfloat16") is None
    assert mfu(1e12, 2.0, 4, None) is None


def test_cpu_peak_is_a_cached_matmul_measurement_split_over_the_cpu_devices() -> None:
    measured = measure_matmul_flops("cpu", "float32", n=256, repeats=2)
    assert 1e8 < measured < 1e14  # a CPU does between 0.1 GFLOP/s and 100 TFLOP/s
    assert measure_matmul_flops("cpu", "float32", n=256, repeats=2) == measured  # cached per process
    cpu = jax.devices("cpu")[0]
    per_device = peak_flops_per_device(cpu, "float32")
    assert per_device == pytest.approx(measure_matmul_flops("cpu", "float32") / len(jax.devices("cpu")))
    assert mfu(per_device, 1.0, len(jax.devices("cpu")), per_device) == pytest.approx(
        1 / len(jax.devices("cpu"))
    )


# ---------------------------------------------------------------------------------- metrics.jsonl, torn


def _records(steps: range) -> str:
    return "".join(json.dumps({"step": s, "kind": "train", "loss": 1.0 / s}) + "\n" for s in steps)


def test_a_torn_last_line_is_skipped_silently_and_the_loss_plot_still_draws(tmp_path: Path) -> None:
    """A run killed mid-append leaves half a record at the end of metrics.jsonl: every later read (the loss
    plot, time_to_quality) must still work."""
    (tmp_path / "metrics.jsonl").write_text(_records(range(1, 4)) + '{"step": 4, "kind": "tr')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the torn last line
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        assert plot_losses(tmp_path).is_file()


def test_an_unreadable_line_before_the_last_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        _records(range(1, 3)).encode() + b'{"step": 3, "ki\n\xff\xfe\n' + _records(range(4, 6)).encode()
    )
    with pytest.warns(DataWarning) as caught:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 4, 5]
    assert [str(w.message) for w in caught] == [
        f"{path} line 3 is not a JSON record; skipped",
        f"{path} line 4 is not a JSON record; skipped",
    ]


def test_the_writer_starts_a_fresh_line_after_a_torn_one(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(_records(range(1, 3)) + '{"step": 3, "kind": "tr')
    writer = MetricsWriter(tmp_path)
    writer.write(3, "train", {"loss": 0.5})
    writer.write(4, "train", {"loss": 0.25})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[2] == '{"step": 3, "kind": "tr'  # the torn record stays on a line of its own
    assert [json.loads(line)["step"] for line in lines[3:]] == [3, 4]
    with pytest.warns(DataWarning, match="line 3 is not a JSON record"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
