"""The step library: a tiny model memorises a batch through the real build/init/step, every optimizer trains,
gradient accumulation equals the big batch, evaluation's bits per byte equals a hand computation, a CPU
splits into as many devices as its cores, the mesh and the batch allow, and every preset's programs lower for
GPUs and TPUs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from minigpt.config import PRESETS, ConfigError, DataConfig, MeshConfig, ModelConfig, TrainConfig, get_preset
from minigpt.data.build import prepare
from minigpt.data.loader import eval_batches
from minigpt.data.mixture import Corpus
from minigpt.inference.evaluate import evaluate
from minigpt.nn.model import GPT
from minigpt.optim.optimizer import SGD, AdamW, ConstantSchedule, Lion, Muon, create_optimizer
from minigpt.parallel import sharding
from minigpt.training.trainer import (
    TrainState,
    build,
    cpu_devices_that_fit,
    cpu_layout,
    init_state,
    make_eval_step,
    make_train_step,
    resolve_weight_decay,
    split_cpu,
    trained,
)

pytestmark = pytest.mark.device  # the model's numerics: also run on an accelerator (`pytest -m device`)

TINY = ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def _cfg(**kw) -> TrainConfig:
    base = TrainConfig(
        model=TINY,
        data=DataConfig(seq_len=16),
        optimizer=AdamW(weight_decay=0.0),
        schedule=ConstantSchedule(warmup_steps=0, peak_lr=3e-3),
        batch_size=4,
    )
    return dataclasses.replace(base, **kw)


def _batch(cfg: TrainConfig, accum: int = 1, seed: int = 0) -> jax.Array:
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (accum, cfg.batch_size, 17), 0, 64)
    return tokens


def _fit_one_batch(cfg: TrainConfig, steps: int) -> tuple[dict, list[float]]:
    """Train on one fixed batch through the real build/init/step; the final state and every step's loss."""
    setup = build(cfg)
    state, step = init_state(setup), make_train_step(setup)
    batch = _batch(cfg)
    losses = []
    for _ in range(steps):
        state, m = step(state, batch, setup.cfg.steps)
        losses.append(float(m["loss"]))
    return state, losses


def test_tiny_model_overfits_one_batch() -> None:
    state, losses = _fit_one_batch(_cfg(), 150)
    assert losses[0] == pytest.approx(math.log(64), rel=0.1)  # starts at chance
    assert losses[-1] < 0.05, losses[-10:]
    assert int(state.step) == 150


@pytest.mark.parametrize(
    "optimizer",
    [AdamW(), SGD(momentum=0.9), Lion(weight_decay=0.1), Muon(adam_lr_ratio=0.1)],
    ids=["adamw", "sgd", "lion", "muon"],
)
def test_every_optimizer_trains_through_the_sharded_train_step(optimizer) -> None:
    lr = {"AdamW": 3e-3, "SGD": 0.3, "Lion": 1e-3, "Muon": 0.02}[type(optimizer).__name__]
    _, losses = _fit_one_batch(
        _cfg(optimizer=optimizer, schedule=ConstantSchedule(warmup_steps=0, peak_lr=lr)), 30
    )
    assert losses[-1] < 0.8 * losses[0], losses


def test_weight_decay_passes_set_the_least_decay_from_the_length_of_a_pass() -> None:
    """--weight-decay-passes P with one pass of E steps: decay at least 1 / (peak lr x P x E), the optimizer's
    own where larger; none for a run from a checkpoint or of unknown pass length. The optimizer built from the
    config applies it: with no gradient, one step shrinks a matrix by lr x decay."""
    cfg = _cfg(
        optimizer=AdamW(weight_decay=0.01), schedule=ConstantSchedule(0, 0.02), weight_decay_passes=1.0
    )
    decay = lambda c, epoch: resolve_weight_decay(c, epoch).optimizer.weight_decay
    assert decay(cfg, 100) == pytest.approx(0.5)
    assert decay(dataclasses.replace(cfg, weight_decay_passes=0.5), 100) == pytest.approx(1.0)
    assert decay(cfg, 100_000) == 0.01  # a large corpus: the optimizer's own is the larger
    for unchanged in (
        dataclasses.replace(cfg, weight_decay_passes=0.0),
        dataclasses.replace(cfg, init_from="x"),
    ):
        assert resolve_weight_decay(unchanged, 100) == unchanged
    assert resolve_weight_decay(cfg, None) == cfg
    resolved = resolve_weight_decay(cfg, 100)
    tx = create_optimizer(resolved.optimizer, resolved.schedule)
    params = {"kernel": jnp.ones((4, 4))}
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    np.testing.assert_allclose(optax.apply_updates(params, updates)["kernel"], 1 - 0.02 * 0.5, rtol=1e-6)


def test_grad_accumulation_equals_the_big_batch_update() -> None:
    # Plain SGD with lr 1: the update *is* the (clipped) gradient, so this compares gradients directly
    # (Adam's first step divides by |g| and would magnify float rounding in near-zero gradients).
    sgd = {"optimizer": SGD(momentum=0.0, clip_gradient_norm=1e9), "schedule": ConstantSchedule(0, 1.0)}
    big = _cfg(batch_size=8, **sgd)
    small = _cfg(batch_size=4, grad_accum=2, **sgd)
    tokens = _batch(big)  # (1, 8, 17)
    s_big = build(big)
    s_small = build(small)
    state_big, m_big = make_train_step(s_big)(init_state(s_big), tokens, 10)
    state_small, m_small = make_train_step(s_small)(init_state(s_small), tokens.reshape(2, 4, 17), 10)
    assert float(m_big["loss"]) == pytest.approx(float(m_small["loss"]), rel=1e-6)  # a few float32 ulps
    for a, b in zip(jax.tree.leaves(state_big.params), jax.tree.leaves(state_small.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bits_per_byte_matches_a_hand_computation(small_corpus: Path, cache_dir: str) -> None:
    data = DataConfig(
        paths=(str(small_corpus),), tokenizer="bpe", bpe_vocab_size=300, seq_len=16, cache_dir=cache_dir
    )
    store = prepare(data)
    tok = store.tokenizer()
    cfg = _cfg(model=dataclasses.replace(TINY, vocab_size=tok.vocab_size), data=data, batch_size=3)
    setup = build(cfg)
    state = init_state(setup)
    result = evaluate(setup, make_eval_step(setup, tok.token_bytes()), state.params, Corpus.single(store))

    # By hand: log-softmax of the model's logits at every real target, in numpy.
    logits_of = jax.jit(lambda params, x: nnx.merge(setup.graphdef, params)(x))  # op by op takes longer
    nll_sum = nll_bytes = n_bytes = n_tokens = 0.0
    table = tok.token_bytes()
    for tokens, weight in eval_batches(store, 16, 3):
        logits = np.asarray(logits_of(state.params, jnp.asarray(tokens[:, :-1])), np.float64)
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        for r in range(len(tokens)):
            if weight[r] == 0:
                continue
            for t in range(16):
                target = tokens[r, t + 1]
                nll = -logp[r, t, target]
                nll_sum += nll
                n_tokens += 1
                if table[target] > 0:
                    nll_bytes += nll
                    n_bytes += table[target]
    assert result["tokens"] == n_tokens
    assert result["loss"] == pytest.approx(nll_sum / n_tokens, rel=1e-5)
    assert result["bpb"] == pytest.approx(nll_bytes / math.log(2) / n_bytes, rel=1e-5)
    # and the byte count is the validation text's UTF-8 length minus the tail that fits no window
    val_text_bytes = store.meta["splits"]["val"]["text_bytes"]
    assert n_bytes <= val_text_bytes and n_bytes > 0.8 * val_text_bytes


def test_the_train_step_keeps_the_ramp_weighted_average_of_the_last_steps_weights() -> None:
    """--average-weights 0.5 over 6 steps: the state's average is the mean of steps 4-6's parameters weighted
    1, 2, 3, a float32 copy beside them, and `with_average` makes it the state's parameters."""
    cfg = _cfg(average_weights=0.5, steps=6)
    setup = build(cfg)
    state, step = init_state(setup), make_train_step(setup)
    seen = []
    for i in range(6):
        state, _ = step(state, _batch(cfg, seed=i), 6)
        seen.append([np.asarray(x) for x in jax.tree.leaves(state.params)])
    for i, average in enumerate(jax.tree.leaves(state.average)):
        assert average.dtype == jnp.float32
        want = (1 * seen[3][i] + 2 * seen[4][i] + 3 * seen[5][i]) / 6
        np.testing.assert_allclose(np.asarray(average), want, rtol=1e-5, atol=1e-7)
    assert not np.allclose(jax.tree.leaves(state.average)[0], seen[5][0])
    averaged = state.with_average()
    for a, b in zip(jax.tree.leaves(averaged.params), jax.tree.leaves(state.average), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_lora_run_averages_its_adapters_and_keeps_its_base() -> None:
    from minigpt.config.lora import LoRAConfig

    cfg = _cfg(model=dataclasses.replace(TINY, lora=LoRAConfig(rank=2)), average_weights=0.5, steps=4)
    setup = build(cfg)
    state, step = init_state(setup), make_train_step(setup)
    adapters, base = trained(state.params)
    assert jax.tree.structure(state.average) == jax.tree.structure(adapters)
    base = [np.asarray(x) for x in jax.tree.leaves(base)]  # the step donates the state's buffers
    for i in range(4):
        state, _ = step(state, _batch(cfg, seed=i), 4)
    averaged = state.with_average()
    assert jax.tree.structure(averaged.params) == jax.tree.structure(state.params)
    for a, b in zip(jax.tree.leaves(trained(averaged.params)[1]), base, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(
        jax.tree.leaves(trained(averaged.params)[0]), jax.tree.leaves(state.average), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("average_weights", [0.0, 0.3])
def test_the_abstract_state_is_what_init_makes_and_restores_onto(average_weights: float) -> None:
    """`build` derives the abstract state from `TrainState.create` alone: the real state must have exactly
    its structure, shapes, dtypes and shardings (a checkpoint restores onto it), and be a TrainState."""
    setup = build(_cfg(average_weights=average_weights))
    state = init_state(setup)
    assert isinstance(state, TrainState) and isinstance(setup.abstract_state, TrainState)
    assert jax.tree.structure(state) == jax.tree.structure(setup.abstract_state)
    for real, abstract in zip(jax.tree.leaves(state), jax.tree.leaves(setup.abstract_state), strict=True):
        assert (real.shape, real.dtype) == (abstract.shape, abstract.dtype)
        assert real.sharding == abstract.sharding
    assert int(state.step) == 0
    assert (state.average is not None) == bool(average_weights)


def test_a_cpu_splits_into_as_many_devices_as_its_cores_the_mesh_and_the_batch_allow() -> None:
    cpu = dataclasses.replace(get_preset("cpu"), batch_size=24)  # mesh data -1, 2 heads, ff 384
    assert [cpu_devices_that_fit(cpu, cores) for cores in (1, 2, 5, 16)] == [1, 2, 4, 12]
    assert cpu_devices_that_fit(dataclasses.replace(cpu, batch_size=5), 4) == 1  # 5 splits over none of 2-4
    tensor = dataclasses.replace(cpu, mesh=MeshConfig(data=-1, tensor=2))
    assert cpu_devices_that_fit(tensor, 7) == 6  # 3 x 2: batch 24 over data 3, the 2 heads over tensor 2
    fixed = dataclasses.replace(cpu, mesh=MeshConfig(data=3, fsdp=1, tensor=1))
    assert [cpu_devices_that_fit(fixed, cores) for cores in (2, 8)] == [1, 3]


def test_a_split_cpu_trains_fsdp_over_its_devices_unless_the_mesh_is_set() -> None:
    """The devices of one CPU share its memory: under FSDP each holds and updates half of the large arrays'
    optimizer state (data parallelism would update all of it on both)."""
    cfg = _cfg(model=dataclasses.replace(TINY, vocab_size=50257, d_model=32))  # a 6.4 MB table and head
    fsdp = cpu_layout(cfg, 2)
    assert (fsdp.mesh.data, fsdp.mesh.fsdp, fsdp.mesh.tensor) == (1, -1, 1)
    assert cpu_layout(cfg, 1) == cfg and cpu_layout(cfg, 0) == cfg  # one device, or the CPU left alone
    for mesh in (MeshConfig(data=2), MeshConfig(data=-1, tensor=2), MeshConfig(data=1, fsdp=2)):
        assert cpu_layout(dataclasses.replace(cfg, mesh=mesh), 2).mesh == mesh
    assert sharding.mesh_shape(fsdp.mesh, 2) == (1, 2, 1)
    # The 6.4 MB table is split over the two devices (the sharding of FSDP itself: test_sharding.py).
    abstract = nnx.state(nnx.eval_shape(lambda: GPT(fsdp.model, nnx.Rngs(0))))
    mesh = jax.sharding.AbstractMesh((1, 2, 1), sharding.MESH_AXES)
    table = sharding.fsdp_sharding(abstract, mesh, min_size_mbytes=fsdp.mesh.fsdp_min_mbytes)["wte"]
    assert "fsdp" in str(jax.tree.leaves(table)[0].spec)


def test_a_started_jax_keeps_its_devices_and_an_explicit_count_it_cannot_set_is_refused() -> None:
    jax.devices()  # this test process's JAX has started: the count is fixed
    have = jax.local_device_count("cpu")
    cfg = _cfg(mesh=MeshConfig(cpu_devices=-1))
    assert split_cpu(cfg, multi_process=False) == 0
    assert split_cpu(_cfg(mesh=MeshConfig(cpu_devices=have)), multi_process=False) == 0
    with pytest.raises(
        ConfigError, match=rf"mesh\.cpu_devices={have + 1} cannot be set: JAX has already started"
    ):
        split_cpu(_cfg(mesh=MeshConfig(cpu_devices=have + 1)), multi_process=False)
    with pytest.raises(ConfigError, match=r"mesh\.cpu_devices must be >= 1 or -1"):
        MeshConfig(cpu_devices=0)


LOWERING_WORKER = """
import dataclasses, json, time
import jax, jax.numpy as jnp, numpy as np
from jax import export
from minigpt.parallel import sharding
from minigpt.config import PRESETS, MeshConfig
from minigpt.inference.generate import STREAM_CHUNK, _decode_chunk, _prefill
from minigpt.tools.bench import bench_config
from minigpt.training.trainer import build, make_eval_step, make_train_step

lowered, t = [], time.perf_counter()
spec = lambda shape, dtype, sh=None: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
for name, preset in PRESETS.items():
    cfg = bench_config(preset)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))  # auto there
    for layout, (d, f, tp) in {"data": (8, 1, 1), "fsdp-tensor": (1, 4, 2)}.items():
        setup = build(dataclasses.replace(cfg, mesh=MeshConfig(data=d, fsdp=f, tensor=tp)))
        c, mesh, platforms = setup.cfg, setup.mesh, ("cuda", "tpu")
        rows, T, V = c.batch_size, c.data.seq_len, c.model.vocab_size
        with sharding.set_mesh(mesh):
            batch_sh, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
            micro = spec((c.grad_accum, rows, T + 1), jnp.int32, sharding.batch_sharding(mesh, micro_batches=True))
            programs = {
                "train": (make_train_step(setup), (setup.abstract_state, micro, spec((), jnp.int32, rep))),
                "eval": (make_eval_step(setup, np.ones(V, np.int32)),
                         (setup.abstract_state.params, spec((rows, T + 1), jnp.int32, batch_sh), spec((rows,), jnp.float32, batch_sh))),
            }
            B, P = 4, 16
            prompt = (setup.graphdef, setup.abstract_state.params, spec((B, P), jnp.int32), spec((B,), jnp.int32),
                      spec((B,), jnp.int32), jax.random.key_data(jax.random.PRNGKey(0)), spec((B,), jnp.int32))
            carry, keys = jax.eval_shape(_prefill, *prompt)
            sampling = dict(steps=STREAM_CHUNK, temperature=1.0, top_k=0, top_p=1.0)
            programs["prefill"] = (_prefill, prompt)
            programs["decode"] = (lambda *a: _decode_chunk(*a, **sampling),
                                  (setup.graphdef, setup.abstract_state.params, carry, keys, prompt[3], prompt[4], np.int32(0)))
            for program, (fn, args) in programs.items():
                exp = export.export(jax.jit(fn, static_argnums=(0,)) if program == "decode" else fn,
                                    platforms=platforms)(*args)
                assert exp.platforms == platforms and exp.nr_devices in (1, 8), (program, exp.nr_devices)
                lowered.append(f"{name}/{layout}/{program}")
print(json.dumps({"lowered": lowered, "seconds": time.perf_counter() - t}))
"""


@pytest.mark.slow
def test_every_presets_programs_lower_for_gpus_and_tpus_on_data_and_fsdp_tensor_layouts() -> None:
    """No GPU or TPU here, but `jax.export` lowers for their platforms: every preset's train step, eval step,
    prefill and decode, in bfloat16 (what auto picks there), on 8 devices laid out data parallel and as
    FSDP x tensor parallel, so a change that breaks an accelerator's program fails here. (The GPU program
    lowered is XLA's attention, `--model.attention mixed`: cuDNN's needs a GPU to trace.)"""
    from conftest import run_on_devices

    result = run_on_devices(LOWERING_WORKER, devices=8)
    expected = {f"{p}/{lay}/{prog}" for p in PRESETS for lay in ("data", "fsdp-tensor")
                for prog in ("train", "eval", "prefill", "decode")}  # fmt: skip
    assert set(result["lowered"]) == expected


def test_rows_of_examples_give_each_example_its_segment_positions_and_targets() -> None:
    from minigpt.data import packing
    from minigpt.training.trainer import Rows

    a = packing.flagged([1, 2, 3, 4], [False, False, True, True])
    b = packing.flagged([5, 6, 7], [False, True, True])
    row = np.concatenate([a, b, [packing.PAD, packing.PAD]]).astype(np.int32)[None]
    rows = Rows.of(jnp.asarray(row), examples=True)
    assert rows.inputs.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert rows.targets.tolist() == [[2, 3, 4, 5, 6, 7, 0, 0]]
    # Targets: the assistant's tokens 3, 4 and 6, 7; never the next example's first token or padding.
    assert rows.counted.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0]]
    assert rows.segments["positions_BT"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    segment = rows.segments["segment_ids"].tolist()[0]
    assert segment[:4] == [1] * 4 and segment[4:7] == [2] * 3 and segment[7] == 3
    text = Rows.of(jnp.asarray(row & packing.ID_MASK), examples=False)
    assert text.segments == {} and float(text.counted.sum()) == 8
