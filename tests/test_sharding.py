"""Meshes and sharding rules; every parallel layout computes what one device computes (8 emulated devices)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import FAST_BACKEND_FLAGS, run_cli, run_on_devices_logged, start_cli
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec
from test_cli import TINY_FLAGS

from minigpt.cli import main
from minigpt.config import ConfigError, MeshConfig, ModelConfig
from minigpt.parallel.sharding import MESH_AXES, gathered, mesh_shape, param_spec, set_mesh


def _mesh(data: int, fsdp: int, tensor: int) -> AbstractMesh:
    return AbstractMesh((data, fsdp, tensor), MESH_AXES)


def test_mesh_shape_fills_the_rest_and_explains_bad_sizes() -> None:
    assert mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="cannot fill 8 devices: 3 does not divide it"):
        mesh_shape(MeshConfig(data=-1, tensor=3), 8)
    with pytest.raises(ConfigError, match=r"= 4 devices, but there are 8; sizes that work: 1x1x8"):
        mesh_shape(MeshConfig(data=2, tensor=2), 8)


def test_fsdp_rule_replicates_small_and_vector_arrays_and_shards_the_largest_divisible_axis() -> None:
    mesh = _mesh(1, 8, 1)
    mb = 2**20
    # big matrix: shard its largest axis divisible by 8
    assert param_spec("w", (1024, 4096), 4, (None, None), mesh, 4) == PartitionSpec(None, "fsdp")
    assert param_spec("w", (4096, 1000), 4, (None, None), mesh, 4) == PartitionSpec("fsdp", None)
    # largest axis not divisible: the next one
    assert param_spec("w", (1000, 4100), 4, (None, None), mesh, 4) == PartitionSpec("fsdp", None)
    # under the size threshold, vectors, scalars: replicated
    assert param_spec("w", (512, 512), 4, (None, None), mesh, 4) == PartitionSpec(None, None)
    assert param_spec("b", (8 * mb,), 4, (None,), mesh, 4) == PartitionSpec(None)
    assert param_spec("s", (), 4, (), mesh, 0) == PartitionSpec()


def test_tensor_axes_come_from_logical_names_and_fsdp_takes_another_axis() -> None:
    mesh = _mesh(2, 2, 2)
    assert param_spec("q", (256, 256), 4, ("embed", "heads"), mesh, 0) == PartitionSpec("fsdp", "tensor")
    assert param_spec("o", (256, 256), 4, ("heads", "embed"), mesh, 0) == PartitionSpec("tensor", "fsdp")
    assert param_spec("wte", (512, 64), 4, ("vocab", "embed"), mesh, 0) == PartitionSpec("tensor", "fsdp")
    with pytest.raises(ConfigError, match=r"dimension 50257 is not divisible by mesh\.tensor=2"):
        param_spec("wte", (50257, 64), 4, ("vocab", "embed"), mesh, 0)


def test_optimizer_state_is_sharded_like_its_parameters_through_masked_states() -> None:
    """Muon's state is a multi_transform of masked states: every moment must still get its parameter's
    sharding (tensor axis from the logical names, then FSDP), and step counts stay replicated."""
    import jax

    from minigpt.nn.model import abstract_model
    from minigpt.optim.optimizer import ConstantSchedule, Muon, create_optimizer
    from minigpt.parallel.sharding import fsdp_sharding

    mesh = _mesh(1, 2, 2)
    _, params = abstract_model(
        ModelConfig(vocab_size=512, max_seq_len=16, d_model=64, n_layers=2, n_heads=4, d_ff=128)
    )
    tx = create_optimizer(Muon(), ConstantSchedule(warmup_steps=0, peak_lr=1e-3))
    opt = jax.eval_shape(tx.init, params)
    specs = lambda tree: {
        jax.tree_util.keystr(p): s.spec
        for p, s in jax.tree_util.tree_leaves_with_path(fsdp_sharding(tree, mesh, min_size_mbytes=0))
    }
    by_param, by_moment = specs(params), specs(opt)
    assert any("tensor" in str(s) for s in by_param.values()) and any(
        "fsdp" in str(s) for s in by_param.values()
    )
    for name, spec in by_param.items():
        mirrors = [v for k, v in by_moment.items() if k.endswith(name)]
        assert mirrors and set(mirrors) == {spec}, (name, mirrors)
    counts = [v for k, v in by_moment.items() if k.endswith("count")]
    assert counts and all(v == PartitionSpec() for v in counts)


def _used_spec(shape: tuple[int, ...], axes: tuple, mesh: AbstractMesh | None, keep: int | None = None):
    """The split `gathered` gives a parameter's value where the model uses it (None: left as stored)."""
    param = nnx.Param(jnp.zeros(shape), axes=axes)
    with set_mesh(mesh) if mesh else contextlib.nullcontext():
        eqns = jax.make_jaxpr(lambda: gathered(param, keep))().jaxpr.eqns
    return eqns[0].params["sharding"].spec if eqns else None


def test_weights_are_used_whole_over_fsdp_but_a_table_keeps_a_split_vocabulary() -> None:
    table = ((512, 64), ("vocab", "embed"))
    assert _used_spec(*table, _mesh(2, 2, 2), keep=0) == PartitionSpec("tensor", None)  # FSDP split the width
    assert _used_spec(*table, _mesh(1, 8, 1), keep=0) is None  # FSDP split the vocabulary: lookups take it so
    assert _used_spec((64, 256), ("embed", "mlp"), _mesh(2, 2, 2)) == PartitionSpec(None, "tensor")
    assert _used_spec((3, 64, 256), ("embed", "mlp"), _mesh(1, 4, 2)) == PartitionSpec(None, None, "tensor")
    assert _used_spec((64, 256), ("embed", "mlp"), _mesh(4, 1, 2)) is None  # no FSDP, nothing to gather
    assert _used_spec((64, 256), ("embed", "mlp"), None) is None  # no mesh


def test_set_mesh_refuses_nesting() -> None:
    mesh = _mesh(1, 1, 1)
    with set_mesh(mesh), pytest.raises(ValueError, match="Cannot nest"), set_mesh(mesh):
        pass


LAYOUTS_WORKER = """
import dataclasses, json
import jax, numpy as np
from minigpt.parallel import sharding
from minigpt.config import DataConfig, MeshConfig, ModelConfig, TrainConfig
from minigpt.optim.optimizer import AdamW, ConstantSchedule
from minigpt.training.trainer import build, init_state, make_train_step

cfg = TrainConfig(
    model=ModelConfig(vocab_size=500, max_seq_len=32, d_model=64, n_layers=1, n_heads=8, d_ff=256, loss_chunk=5),
    data=DataConfig(seq_len=16), batch_size=16,
    optimizer=AdamW(weight_decay=0.1), schedule=ConstantSchedule(warmup_steps=2, peak_lr=3e-3),
)
batches = [jax.random.randint(jax.random.PRNGKey(0), (1, 16, 17), 0, 500)] * 5  # one batch, so loss must fall
results = {}
layouts = {"unchunked": (1, 1, 1), "single": (1, 1, 1), "data8": (8, 1, 1), "fsdp8": (1, 8, 1), "data4_tensor2": (4, 1, 2),
           "data2_fsdp4": (2, 4, 1), "data2_fsdp2_tensor2": (2, 2, 2), "tensor8": (1, 1, 8)}
bf16 = ("unchunked", "single", "fsdp8", "data2_fsdp2_tensor2", "tensor8")  # each kind of split, in mixed precision
runs = [("float32", item) for item in layouts.items()] + [("bfloat16", (n, layouts[n])) for n in bf16]
for dtype, (name, (d, f, t)) in runs:
    run = dataclasses.replace(cfg, mesh=MeshConfig(data=d, fsdp=f, tensor=t, fsdp_min_mbytes=0))
    if name == "unchunked":  # the output layer's full logits at once: the reference for the chunked loss
        run = dataclasses.replace(run, model=dataclasses.replace(cfg.model, loss_chunk=0))
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, dtype=dtype))
    name = name if dtype == "float32" else f"{name}/{dtype}"
    setup = build(run, jax.devices()[: d * f * t])
    with sharding.set_mesh(setup.mesh):
        state, step = init_state(setup), make_train_step(setup)
        losses, grad_norms = [], []
        for b in batches:
            state, m = step(state, b, setup.cfg.steps)
            losses.append(float(m["loss"]))
            grad_norms.append(float(m["grad_norm"]))
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    mu = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state) if "mu" in jax.tree_util.keystr(p)}
    arrays = jax.tree.leaves((state.params, state.opt_state))
    results[name] = {
        "losses": losses,
        "grad_norms": grad_norms,
        "specs": {k: [None if a is None else (a if isinstance(a, str) else list(a)) for a in x.sharding.spec] for k, x in flat.items()},
        "mu_specs": {k: [None if a is None else (a if isinstance(a, str) else list(a)) for a in x.sharding.spec] for k, x in mu.items()},
        "device0_bytes": sum(s.data.nbytes for x in arrays for s in x.addressable_shards if s.device == setup.mesh.devices.flat[0]),
        "total_bytes": sum(x.nbytes for x in arrays),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def layouts_logged() -> tuple[dict, str]:
    return run_on_devices_logged(LAYOUTS_WORKER)


@pytest.fixture(scope="module")
def layouts(layouts_logged: tuple[dict, str]) -> dict:
    return layouts_logged[0]


def _spec(results: dict, layout: str, suffix: str) -> list:
    (spec,) = [v for k, v in results[layout]["specs"].items() if k.endswith(suffix)]
    return spec


LAYOUT_NAMES = ["single", "data8", "fsdp8", "data4_tensor2", "data2_fsdp4", "data2_fsdp2_tensor2", "tensor8"]
BF16_LAYOUTS = ["single", "fsdp8", "data2_fsdp2_tensor2", "tensor8"]
F32_TOLERANCES, BF16_TOLERANCES = (1e-4, 1e-4, 1e-4), (2e-4, 2e-3, 2.5e-2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "dtype", "losses_rel", "first_rel", "norms_rel"),
    [(name, "float32", *F32_TOLERANCES) for name in LAYOUT_NAMES]
    + [(name, "bfloat16", *BF16_TOLERANCES) for name in BF16_LAYOUTS],
)
def test_every_layout_matches_the_single_device_unchunked_losses(
    layouts: dict, layout: str, dtype: str, losses_rel: float, first_rel: float, norms_rel: float
) -> None:
    """Chunked output layer (T = 16 in chunks of 5, the last padded) on every layout, the tensor-parallel
    vocabulary included, against the full logits on one device: same losses and gradient norms, to float32's
    precision, and in mixed precision to bfloat16's. There a sharded product sums its parts in another order
    and bfloat16 rounds what follows: the first step's gradient norm, at equal weights, moves by 0.1%; Adam's
    first updates, normalised per weight, carry such differences into the weights, and later norms move by up
    to 2% (the full logits in bfloat16 are 0.6% from float32's)."""
    suffix = "" if dtype == "float32" else f"/{dtype}"
    reference, run = layouts["unchunked" + suffix], layouts[layout + suffix]
    assert reference["losses"][-1] < reference["losses"][0]
    assert run["losses"] == pytest.approx(reference["losses"], rel=losses_rel)
    assert run["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=first_rel)
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=norms_rel)


@pytest.mark.slow
def test_no_layout_leaves_xla_to_replicate_what_it_cannot_move(layouts_logged: tuple[dict, str]) -> None:
    """Token and position lookups from tables whose width FSDP splits (the vocabulary taken by the tensor
    axis, or the narrower axis), target columns from the output layer, and products with weights split on
    their output axis: XLA cannot move those splits onto the batch, says "Involuntary full
    rematerialization" on stderr, and replicates the value on every device. Gathering each weight over FSDP
    before use (`sharding.gathered`) leaves it nothing to replicate, in any layout or dtype."""
    lines = [line for line in layouts_logged[1].splitlines() if "Involuntary full rematerialization" in line]
    assert not lines, f"{len(lines)} replications, the first: {lines[0][:600]}"


@pytest.mark.slow
def test_parameters_and_optimizer_state_carry_the_expected_shardings(layouts: dict) -> None:
    q, down = "['blocks'][0]['attn']['q']['kernel'].value", "['blocks'][0]['mlp']['down']['kernel'].value"
    wte, ln = "['wte'].value", "['blocks'][0]['ln1']['scale'].value"
    assert _spec(layouts, "data8", q) == [None, None]
    assert _spec(layouts, "fsdp8", q) == [None, "fsdp"]  # (64, 64): ties go to the last axis, as in the seed
    assert _spec(layouts, "fsdp8", down) == ["fsdp", None]  # (256, 64)
    assert _spec(layouts, "fsdp8", ln) == [None]  # vectors stay replicated
    assert _spec(layouts, "data4_tensor2", q) == [None, "tensor"]  # heads split: column parallel
    assert _spec(layouts, "data4_tensor2", down) == ["tensor", None]  # row parallel
    assert _spec(layouts, "data4_tensor2", wte) == ["tensor", None]  # vocab parallel
    assert _spec(layouts, "data2_fsdp2_tensor2", q) == ["fsdp", "tensor"]
    assert _spec(layouts, "tensor8", wte) == ["tensor", None]  # 500 padded to 512 divides by 8
    for layout in LAYOUT_NAMES:  # Adam's moments are sharded exactly like their parameters
        mu = layouts[layout]["mu_specs"]
        for k, spec in layouts[layout]["specs"].items():
            (match,) = [v for name, v in mu.items() if name.endswith(k.removesuffix(".value")) or k in name]
            assert match == spec, (layout, k)


@pytest.mark.slow
def test_fsdp8_cuts_per_device_state_memory_to_under_a_sixth(layouts: dict) -> None:
    single = layouts["data8"]
    fsdp = layouts["fsdp8"]
    assert single["device0_bytes"] == single["total_bytes"]  # data parallel replicates everything
    assert fsdp["device0_bytes"] <= single["device0_bytes"] / 6, (
        fsdp["device0_bytes"] / single["device0_bytes"]
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_losses(run: Path) -> dict[int, float]:
    from minigpt.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}


@pytest.mark.slow
def test_two_processes_match_one_process_and_their_checkpoint_restores_in_one(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """2 processes x 4 CPU devices (coordinator on 127.0.0.1, gloo collectives) train exactly as 1 x 8 does.

    The 1 x 8 reference runs side by side with the pair (they wait on each other's collectives); all three
    start as `run_cli` would run them (no PyTorch, the session's compilation cache), with FAST_BACKEND_FLAGS."""
    flags = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), *TINY_FLAGS,
             "--batch-size", "8", "--steps", "6", "--log-every", "1", "--eval-every", "6", "--sample-tokens", "4"]  # fmt: skip
    one = start_cli(
        *flags,
        "--run-dir",
        str(tmp_path / "one"),
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {FAST_BACKEND_FLAGS}"},
    )

    port = _free_port()
    dist = [
        "--run-dir",
        str(tmp_path / "two"),
        "--dist.coordinator",
        f"127.0.0.1:{port}",
        "--dist.num-processes",
        "2",
    ]
    procs = [
        start_cli(
            *flags,
            *dist,
            "--dist.process-id",
            str(i),
            env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_BACKEND_FLAGS}"},
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    _, one_err = one.communicate(timeout=600)
    assert one.returncode == 0, one_err[-3000:]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "2 process(es)" in outs[0][0] and "mesh {'data': 8" in outs[0][0]
    assert not [
        line for line in outs[1][0].splitlines() if line.startswith(("step", "model", "done"))
    ]  # only 0 logs

    ref, multi = _train_losses(tmp_path / "one"), _train_losses(tmp_path / "two")
    assert sorted(multi) == list(range(1, 7))
    # Each process feeds its own half of every global batch: same windows, so the same losses.
    assert [multi[s] for s in sorted(multi)] == pytest.approx([ref[s] for s in sorted(ref)], rel=1e-4)

    # The checkpoint the two processes wrote together restores in a single one-device process: this one.
    final_val = next(line for line in outs[0][0].splitlines() if line.startswith("step      6 | val loss"))
    main(["eval", "--run", str(tmp_path / "two")])
    ev = capsys.readouterr().out
    assert ev.strip().startswith("step 6 | val loss")
    assert float(ev.split("val loss ")[1].split()[0]) == pytest.approx(
        float(final_val.split("val loss ")[1].split()[0]), rel=1e-4
    )


def test_unreachable_coordinator_is_a_one_line_error(tmp_path: Path) -> None:
    out = run_cli("train", "--dist.coordinator", f"127.0.0.1:{_free_port()}", "--dist.num-processes", "2",
                  "--dist.process-id", "1", "--dist.timeout-s", "2", "--data.cache-dir", str(tmp_path))  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().startswith("minigpt: error: coordinator 127.0.0.1:")
    assert "unreachable within 2s" in out.stderr and len(out.stderr.strip().splitlines()) == 1
