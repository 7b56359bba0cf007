"""Check `minigpt plan` against XLA: for a spread of small CPU configurations, the planned per-device memory of
a training step next to what XLA's compiled step needs (`compiled.memory_analysis()`: argument + output -
aliased + temporaries), each compiled from abstract shapes on 1 or 8 emulated CPU devices (nothing is
allocated or run). Prints a markdown table; exits 1 if any row is off by more than --tolerance.

    python benchmarks/plan_check.py                  # every row
    python benchmarks/plan_check.py --rows 0 3       # some of them
    python benchmarks/plan_check.py --quick          # the two smallest rows
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from common import parser, print_tables, table, write_result

DEVICES = 8


def _reexec_with_devices() -> None:
    """XLA fixes the CPU device count when JAX starts: run again with 8 emulated devices."""
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def configs() -> list[tuple[str, int, object]]:
    """(description, devices, TrainConfig) rows: widths, vocabularies, remat policies, loss chunking, FSDP."""
    from minigpt.config import PRESETS, MeshConfig
    from minigpt.optim.optimizer import AdamW

    # The cpu preset's block (pre-norm RMSNorm, RoPE, ReLU², QK-norm, tied) at d 256 with AdamW: a wider model
    # than the preset's, so the terms the plan adds up are large enough to check.
    # float32 unless a row says bfloat16 (which the plan counts less closely on CPU: BF16_TOLERANCE).
    base = PRESETS["cpu"]
    base = dataclasses.replace(
        base, optimizer=AdamW(weight_decay=0.1), batch_size=32,
        model=dataclasses.replace(base.model, d_model=256, n_heads=4, d_ff=1024, dtype="float32"),
    )  # fmt: skip
    tutorial = dataclasses.replace(PRESETS["tutorial"].model, dtype="float32")  # post-norm, learned, untied

    def cfg(batch: int, seq: int = 128, vocab: int = 4096, mesh: MeshConfig | None = None, model=None, **kw):
        m = dataclasses.replace(model or base.model, vocab_size=vocab, max_seq_len=max(seq, 128), **kw)
        data = dataclasses.replace(base.data, seq_len=seq)
        return dataclasses.replace(base, model=m, data=data, batch_size=batch, mesh=mesh or MeshConfig())

    tutorial_144 = PRESETS["tutorial"]
    model = dataclasses.replace(tutorial, vocab_size=50257, loss_chunk=0)
    tutorial_144 = dataclasses.replace(tutorial_144, model=model)
    d384 = {"d_model": 384, "n_layers": 6, "n_heads": 6, "d_ff": 1536}
    d128 = {"d_model": 128, "n_heads": 2, "d_ff": 512}
    d64 = {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 256}
    fsdp8 = MeshConfig(data=1, fsdp=8, fsdp_min_mbytes=0)
    data2_fsdp4 = MeshConfig(data=2, fsdp=4, fsdp_min_mbytes=0)
    data2_fsdp2_tensor2 = MeshConfig(data=2, fsdp=2, tensor=2, fsdp_min_mbytes=0)
    return [
        ("d256 L4, BPE 4096, b32 x 128, chunk 32", 1, cfg(32)),
        ("d256 L4, BPE 4096, b32 x 128, unchunked", 1, cfg(32, loss_chunk=0)),
        ("d256 L4, GPT-2 50257, b16 x 128, chunk 32", 1, cfg(16, vocab=50257)),
        ("d256 L4, GPT-2 50257, b16 x 128, unchunked", 1, cfg(16, vocab=50257, loss_chunk=0)),
        ("tutorial preset, b144 x 256, unchunked (the ~36 GB step)", 1, tutorial_144),
        (
            "tutorial block (untied, biases) d256 ff256, GPT-2 50257, b8 x 256, unchunked",
            1,
            cfg(8, 256, 50257, model=tutorial, dropout=0.0, loss_chunk=0),
        ),
        (
            "d384 L6 scanned, remat full, BPE 4096, b16 x 256",
            1,
            cfg(16, 256, scan_layers=True, remat="full", **d384),
        ),
        (
            "d128 L4 scanned, remat dots, BPE 4096, b32 x 256",
            1,
            cfg(32, 256, scan_layers=True, remat="dots", **d128),
        ),
        (
            "d256 L4 scanned, remat projections, BPE 4096, b32 x 128",
            1,
            cfg(32, scan_layers=True, remat="projections"),
        ),
        ("d256 L4, BPE 4096, b32 x 128, FSDP 8", 8, cfg(32, mesh=fsdp8)),
        ("d256 L4, GPT-2 50257, b64 x 128, data 2 x FSDP 4", 8, cfg(64, vocab=50257, mesh=data2_fsdp4)),
        (
            "d256 L4, GPT-2 50257, b64 x 128, data 2 x FSDP 2 x tensor 2",
            8,
            cfg(64, vocab=50257, mesh=data2_fsdp2_tensor2),
        ),
        (
            "d64 L2, BPE 4096, b16 x 64, 4 micro-batches",
            1,
            dataclasses.replace(cfg(16, 64, **d64), grad_accum=4),
        ),
        ("d256 L4, BPE 4096, b32 x 128, chunk 32, bfloat16", 1, cfg(32, dtype="bfloat16")),
        (
            "d128 L4 scanned, remat dots, BPE 4096, b32 x 256, bfloat16",
            1,
            cfg(32, 256, scan_layers=True, remat="dots", dtype="bfloat16", **d128),
        ),
    ]


QUICK_ROWS = (0, 12)
BF16_TOLERANCE = 0.3
"""XLA:CPU keeps more in a bfloat16 step than the plan's residuals say (the float32 products before they are
rounded, the transposed copies the backward products read): the plan runs up to a quarter under it."""


def main() -> None:
    _reexec_with_devices()
    import jax

    from minigpt.tools.plan import measure
    from minigpt.training.memory import make_plan

    p = parser(__doc__)
    p.add_argument("--rows", type=int, nargs="*", help="row indices to run (default: all)")
    p.add_argument("--tolerance", type=float, default=0.15, help="for float32 rows")
    p.add_argument("--bf16-tolerance", type=float, default=BF16_TOLERANCE, help="for bfloat16 rows")
    args = p.parse_args()
    rows = configs()
    chosen = QUICK_ROWS if args.quick else (args.rows or range(len(rows)))
    mib = lambda n: f"{n / 2**20:,.1f}"
    out, worst, t0 = [], {"float32": 0.0, "bfloat16": 0.0}, time.perf_counter()
    for i in chosen:
        name, n, cfg = rows[i]
        plan = make_plan(cfg, "cpu", n)
        xla = measure(cfg, jax.devices()[:n])
        off = plan.total / xla - 1
        worst[cfg.model.dtype] = max(worst[cfg.model.dtype], abs(off))
        t = plan.terms
        state = t["parameters"] + t["optimizer state"] + t["gradients"]
        transient = max(("logits", "layer backward", "optimizer update"), key=t.__getitem__)
        out.append([i, name, n, mib(state), mib(t["activations"]), f"{transient} {mib(t[transient])}",
                    mib(plan.total), mib(xla), f"{off:+.1%}"])  # fmt: skip
        print(" | ".join(map(str, out[-1])), flush=True)
    columns = ["#", "config", "devices", "state", "activations", "largest transient", "plan MiB", "XLA MiB",
               "plan vs XLA"]  # fmt: skip
    note = (
        f"Worst: float32 {worst['float32']:.1%} (tolerance {args.tolerance:.0%}), bfloat16 {worst['bfloat16']:.1%} "
        f"(tolerance {args.bf16_tolerance:.0%}); {time.perf_counter() - t0:.0f} s."
    )
    tables = [table(columns, out, "Planned per-device memory against XLA's compiled step", note)]
    print_tables(tables)
    headlines = [
        f"`minigpt plan` predicts a float32 step's memory within {worst['float32']:.0%} of XLA's own figure, "
        f"a bfloat16 one on CPU within {worst['bfloat16']:.0%}"
    ]
    write_result(args, "plan_check", "minigpt plan against XLA", tables, headlines=headlines, data=out)
    sys.exit(1 if worst["float32"] > args.tolerance or worst["bfloat16"] > args.bf16_tolerance else 0)


if __name__ == "__main__":
    main()
