import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from minigpt.optim import optimizer as opt
from minigpt.runtime.errors import ConfigError

D, H, V, C = 8, 16, 16, 4


# ---------------------------------------------------------------------------------------------------------
# Schedules: compare against closed forms written with python math, at python ints and under jit.


def _warmup(step: int, warmup: int, peak: float) -> float:
    init = peak / (warmup + 1)
    return init + (peak - init) * step / warmup


def _cosine(step: int, warmup: int, peak: float, decay_steps: int, end: float) -> float:
    if step < warmup:
        return _warmup(step, warmup, peak)
    t = min(step - warmup, decay_steps - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t / (decay_steps - warmup)))


def _rsqrt(step: int, warmup: int, peak: float, timescale: float) -> float:
    if step < warmup:
        return _warmup(step, warmup, peak)
    return peak / math.sqrt((timescale + step - warmup) / timescale)


def _wsd(step: int, warmup: int, peak: float, total: int, decay: int, floor_frac: float, shape: str) -> float:
    if step < warmup:
        return _warmup(step, warmup, peak)
    floor = floor_frac * peak
    progress = min(max((step - (total - decay)) / decay, 0.0), 1.0)
    remaining = 1 - progress if shape == "linear" else 1 - math.sqrt(progress)
    return floor + (peak - floor) * remaining


def _constant(step: int, warmup: int, peak: float) -> float:
    return _warmup(step, warmup, peak) if step < warmup else peak


STEPS = [0, 1, 5, 9, 10, 11, 50, 88, 99, 109, 110, 111, 500]

SCHEDULE_CASES = [
    (
        opt.CosineDecaySchedule(warmup_steps=10, peak_lr=1e-3, decay_steps=110, decay_lr=1e-4),
        lambda s: _cosine(s, 10, 1e-3, 110, 1e-4),
    ),
    (
        opt.CosineDecaySchedule(warmup_steps=0, peak_lr=1e-3, decay_steps=110, decay_lr=0.0),
        lambda s: _cosine(s, 0, 1e-3, 110, 0.0),
    ),
    (
        opt.RsqrtDecaySchedule(warmup_steps=10, peak_lr=1e-3, timescale=100),
        lambda s: _rsqrt(s, 10, 1e-3, 100),
    ),
    (
        # decay_fraction 0.2 of 110 steps -> 22 decay steps starting at step 88.
        opt.WSDSchedule(
            warmup_steps=10,
            peak_lr=1e-3,
            total_steps=110,
            decay_fraction=0.2,
            final_lr_fraction=0.1,
            shape="linear",
        ),
        lambda s: _wsd(s, 10, 1e-3, 110, 22, 0.1, "linear"),
    ),
    (
        opt.WSDSchedule(
            warmup_steps=10,
            peak_lr=1e-3,
            total_steps=110,
            decay_fraction=0.2,
            final_lr_fraction=0.0,
            shape="1-sqrt",
        ),
        lambda s: _wsd(s, 10, 1e-3, 110, 22, 0.0, "1-sqrt"),
    ),
    (
        opt.WSDSchedule(warmup_steps=0, peak_lr=1e-3, total_steps=110, decay_fraction=1.0, shape="linear"),
        lambda s: _wsd(s, 0, 1e-3, 110, 110, 0.0, "linear"),
    ),
    (opt.ConstantSchedule(warmup_steps=10, peak_lr=1e-3), lambda s: _constant(s, 10, 1e-3)),
    (opt.ConstantSchedule(warmup_steps=0, peak_lr=1e-3), lambda s: _constant(s, 0, 1e-3)),
]


@pytest.mark.parametrize(("config", "closed_form"), SCHEDULE_CASES, ids=[repr(c) for c, _ in SCHEDULE_CASES])
def test_schedule_matches_closed_form(config: opt.LRScheduleConfig, closed_form) -> None:
    assert isinstance(config, opt.LRScheduleConfig)
    schedule = config.create()
    jitted = jax.jit(schedule)
    for step in STEPS:
        expected = closed_form(step)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step
        assert float(jitted(jnp.asarray(step, jnp.int32))) == pytest.approx(expected, rel=1e-5, abs=1e-9), (
            step
        )


def test_schedule_landmarks() -> None:
    """Spot-check the values the closed forms are supposed to encode, so a shared mistake cannot hide."""
    cosine = opt.CosineDecaySchedule(warmup_steps=10, peak_lr=1.0, decay_steps=110, decay_lr=0.1).create()
    assert float(cosine(0)) == pytest.approx(1 / 11)
    assert float(cosine(10)) == pytest.approx(1.0)
    assert float(cosine(60)) == pytest.approx(0.55)
    assert float(cosine(110)) == pytest.approx(0.1)
    assert float(cosine(1000)) == pytest.approx(0.1)
    rsqrt = opt.RsqrtDecaySchedule(warmup_steps=10, peak_lr=1.0, timescale=100).create()
    assert float(rsqrt(310)) == pytest.approx(0.5)
    wsd = opt.WSDSchedule(warmup_steps=10, peak_lr=1.0, total_steps=110, decay_fraction=0.2, shape="1-sqrt")
    assert wsd.decay_steps(110) == 22
    assert float(wsd.create()(87)) == pytest.approx(1.0)
    assert float(wsd.create()(88 + 11)) == pytest.approx(1 - math.sqrt(0.5))
    assert float(wsd.create()(110)) == pytest.approx(0.0, abs=1e-12)


def test_a_schedule_of_length_0_follows_the_run_even_when_its_length_is_traced() -> None:
    """Length 0 takes the run's length, which a time-budgeted run passes into the compiled step as a traced
    scalar: the values equal those of the explicit length, and before the decay they do not depend on it."""
    for follow, explicit in [
        (opt.WSDSchedule(warmup_steps=10, peak_lr=1.0, decay_fraction=0.2), lambda n: opt.WSDSchedule(
            warmup_steps=10, peak_lr=1.0, total_steps=n, decay_fraction=0.2)),
        (opt.CosineDecaySchedule(warmup_steps=10, peak_lr=1.0, decay_lr=0.1), lambda n: opt.CosineDecaySchedule(
            warmup_steps=10, peak_lr=1.0, decay_steps=n, decay_lr=0.1)),
    ]:  # fmt: skip
        traced = jax.jit(lambda step, n, f=follow: f.create(n)(step))
        for n in (110, 400):
            want = explicit(n).create()
            for step in (0, 5, 10, 50, 87, 99, 109, 110, 300, 399):
                assert float(traced(step, n)) == pytest.approx(float(want(step)), rel=1e-6, abs=1e-9)
        assert float(traced(9, 110)) == float(traced(9, 400))  # warmup: the same whatever the length
    wsd = opt.WSDSchedule(warmup_steps=10, peak_lr=1.0, decay_fraction=0.2)
    assert [float(wsd.create(400)(s)) for s in (50, 200, 319)] == [1.0, 1.0, 1.0]  # stable until 320
    with pytest.raises(ConfigError, match="is 0 \\(follow the run's length\\) but no run length was given"):
        wsd.create()


@pytest.mark.parametrize("run_steps, fraction", [(20, 0.3), (21, 0.5), (7, 0.9)])
def test_the_streaming_weight_average_is_the_mean_of_the_last_steps_weighted_by_their_place(
    run_steps: int, fraction: float
) -> None:
    """avg += average_rate x (w - avg) after every update gives, at the run's end, the mean of the weights of
    the last round(fraction x run_steps) updates, the n-th of them weighted n; the same with the run's length
    traced (a --max-time run), and the weights themselves until the averaged updates begin."""
    weights = np.random.default_rng(0).normal(size=(run_steps, 3))
    traced = jax.jit(lambda step, n: opt.average_rate(step, n, fraction))
    average = np.zeros(3)
    for step, w in enumerate(weights, start=1):
        rate = float(opt.average_rate(jnp.int32(step), run_steps, fraction))
        assert rate == pytest.approx(float(traced(step, jnp.int32(run_steps))), rel=1e-7)
        average = average + rate * (w - average)
        if step <= opt.average_start(run_steps, fraction) + 1:
            np.testing.assert_allclose(average, w, rtol=1e-12)
    k = round(fraction * run_steps)
    ramp = np.arange(1, k + 1, dtype=np.float64)
    np.testing.assert_allclose(average, ramp @ weights[-k:] / ramp.sum(), rtol=1e-5)
    assert opt.average_start(run_steps, fraction) == int(opt.average_start(jnp.int32(run_steps), fraction))


def test_a_long_linear_decay_ends_at_one_decay_step_of_the_peak() -> None:
    """The last step of a long linear decay runs at peak / decay_steps to float32 precision, whether the run's
    length is known or traced (a --max-time run): 1 - progress would lose it to cancellation."""
    wsd = opt.WSDSchedule(warmup_steps=20, peak_lr=1e-2, decay_fraction=0.5, shape="linear")
    traced = jax.jit(lambda step, n: wsd.create(n)(step))
    for total in (7_299, 7_301, 100_001):
        decay = round(0.5 * total)
        for lr in (wsd.create(total)(total - 1), traced(total - 1, total)):
            assert float(lr) == pytest.approx(1e-2 / decay, rel=1e-6), (total, float(lr))


def test_a_run_shorter_than_warmup_plus_decay_still_decays_to_the_end() -> None:
    """A follow-the-run WSD whose run is shorter than its warmup plus decay (a tiny time budget) is not an
    error: the decay cuts the warmup short, and the last step still ends near zero."""
    wsd = opt.WSDSchedule(warmup_steps=30, peak_lr=1.0, decay_fraction=0.5, shape="linear").create(20)
    lrs = [float(wsd(s)) for s in range(20)]
    assert lrs[0] == pytest.approx(1 / 31) and lrs[-1] == pytest.approx(0.1)
    assert lrs.index(max(lrs)) == 15 and max(lrs) == pytest.approx(0.5)  # where the ramp meets the decay


# ---------------------------------------------------------------------------------------------------------
# Params following the model's naming convention. Test data is numpy so no eager op needs compiling.


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


def _gpt_like_params(stacked: bool = False) -> dict:
    """A realistic nested 2-layer GPT param dict, optionally with the layers stacked for scan."""
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return _f32(0.1 * rng.standard_normal(shape))

    def block() -> dict:
        return {
            "ln_1": {"scale": _f32(np.ones(D)), "bias": _f32(np.zeros(D))},
            "attn": {
                "c_attn": {"kernel": normal(D, 3 * D), "bias": _f32(np.zeros(3 * D))},
                "c_proj": {"kernel": normal(D, D), "bias": _f32(np.zeros(D))},
            },
            "ln_2": {"scale": _f32(np.ones(D)), "bias": _f32(np.zeros(D))},
            "mlp": {
                "c_fc": {"kernel": normal(D, 4 * D), "bias": _f32(np.zeros(4 * D))},
                "c_proj": {"kernel": normal(4 * D, D), "bias": _f32(np.zeros(D))},
            },
        }

    blocks = [block(), block()]
    return {
        "wte": {"embedding": normal(V, D)},
        "wpe": {"embedding": normal(12, D)},
        "blocks": _stack(*blocks) if stacked else {"0": blocks[0], "1": blocks[1]},
        "ln_f": {"scale": _f32(np.ones(D)), "bias": _f32(np.zeros(D))},
        "lm_head": {"kernel": normal(D, V)},
        "logit_scale": _f32(np.ones(())),
    }


def _stack(*layers: dict) -> dict:
    return jax.tree.map(lambda *x: np.stack(x), *layers)


def _zeros_like(tree: dict) -> dict:
    return jax.tree.map(np.zeros_like, tree)


def _random_like(tree: dict, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: _f32(rng.standard_normal(p.shape)), tree)


def _get(tree: dict, path: tuple[str, ...]) -> np.ndarray:
    for key in path:
        tree = tree[key]
    return np.asarray(tree)


def _expected_decay(path: jax.tree_util.KeyPath) -> bool:
    return path[-1].key in ("kernel", "embedding")


def _expected_label(path: jax.tree_util.KeyPath) -> str:
    hidden = path[0].key not in ("wte", "wpe", "lm_head")
    return "muon" if hidden and path[-1].key == "kernel" else "adam"


@pytest.mark.parametrize("stacked", [False, True])
def test_default_weight_decay_mask(stacked: bool) -> None:
    params = _gpt_like_params(stacked)
    expected = jax.tree_util.tree_map_with_path(lambda p, _: _expected_decay(p), params)
    assert opt.default_weight_decay_mask(params) == expected
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert opt.default_weight_decay_mask(shapes) == expected
    # wte, wpe, lm_head and 4 kernels per block (one stacked block).
    assert sum(jax.tree.leaves(expected)) == 3 + 4 * (1 if stacked else 2)


@pytest.mark.parametrize("stacked", [False, True])
def test_muon_labels(stacked: bool) -> None:
    params = _gpt_like_params(stacked)
    expected = jax.tree_util.tree_map_with_path(lambda p, _: _expected_label(p), params)
    assert opt.muon_labels(params) == expected
    [(wte_path, _)] = jax.tree_util.tree_leaves_with_path({"wte": {"embedding": 0}})
    [(mlp_path, _)] = jax.tree_util.tree_leaves_with_path({"mlp": {"kernel": 0}})
    assert opt.is_embedding_or_head(wte_path)
    assert not opt.is_embedding_or_head(mlp_path)


# ---------------------------------------------------------------------------------------------------------
# Optimizer mechanics.


MUON = opt.Muon(weight_decay=0.1, clip_gradient_norm=float("inf"))
ALL_OPTIMIZERS = [opt.AdamW(), opt.SGD(weight_decay=0.1), opt.Lion(), MUON]
LR = 0.02


@functools.cache
def _first_step(config: opt.OptimizerConfig) -> Callable[[dict, dict], dict]:
    """(grads, params) -> first update at a constant LR; cached so tests share one compilation per config."""
    tx = opt.create_optimizer(config, opt.ConstantSchedule(warmup_steps=0, peak_lr=LR))
    return jax.jit(lambda grads, params: tx.update(grads, tx.init(params), params)[0])


def _branch_lr(config: opt.OptimizerConfig, path: jax.tree_util.KeyPath) -> float:
    if isinstance(config, opt.Muon) and _expected_label(path) == "adam":
        return LR * config.adam_lr_ratio
    return LR


@pytest.mark.parametrize("config", ALL_OPTIMIZERS, ids=lambda c: type(c).__name__)
def test_weight_decay_is_decoupled_and_masked(config: opt.OptimizerConfig) -> None:
    """With zero gradients the only update is -lr * weight_decay * param, on the masked leaves only."""
    params = _gpt_like_params()
    updates = _first_step(config)(_zeros_like(params), params)

    def expected(path: jax.tree_util.KeyPath, p: np.ndarray) -> np.ndarray:
        decay = config.weight_decay if _expected_decay(path) else 0.0
        return -_branch_lr(config, path) * decay * p

    jax.tree.map(
        lambda u, e: np.testing.assert_allclose(u, e, rtol=1e-6, atol=1e-9),
        updates,
        jax.tree_util.tree_map_with_path(expected, params),
    )


def test_explicit_weight_decay_mask_tree() -> None:
    """A bool pytree (not a callable) also works, including through Muon's two branches."""
    ones = _f32(np.ones((4, 4)))
    params = {
        "blocks": {"0": {"mlp": {"kernel": ones}}, "1": {"mlp": {"kernel": ones}}},
        "lm_head": {"kernel": ones},
        "ln_f": {"scale": _f32(np.ones(4))},
    }
    mask = {
        "blocks": {"0": {"mlp": {"kernel": True}}, "1": {"mlp": {"kernel": False}}},
        "lm_head": {"kernel": True},
        "ln_f": {"scale": True},
    }
    tx = opt.create_optimizer(MUON, opt.ConstantSchedule(warmup_steps=0, peak_lr=LR), weight_decay_mask=mask)
    updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(_zeros_like(params), params)
    decay, adam_decay = -LR * MUON.weight_decay, -LR * MUON.adam_lr_ratio * MUON.weight_decay
    np.testing.assert_allclose(updates["blocks"]["0"]["mlp"]["kernel"], decay, rtol=1e-6)
    np.testing.assert_allclose(updates["blocks"]["1"]["mlp"]["kernel"], 0.0)
    np.testing.assert_allclose(updates["lm_head"]["kernel"], adam_decay, rtol=1e-6)
    np.testing.assert_allclose(updates["ln_f"]["scale"], adam_decay, rtol=1e-6)


def test_clipping_bounds_update_norm() -> None:
    params = {"mlp": {"kernel": _f32(np.ones((D, H))), "bias": _f32(np.ones(H))}}
    tx = opt.SGD(momentum=0.0, clip_gradient_norm=0.25).create(1.0)
    update = jax.jit(lambda g: tx.update(g, tx.init(params), params)[0])
    huge = jax.tree.map(lambda p: 1e6 * p, params)
    assert float(optax.tree.norm(update(huge))) == pytest.approx(0.25, rel=1e-5)
    # Small gradients pass through untouched.
    small = jax.tree.map(lambda p: 1e-3 * p, params)
    jax.tree.map(lambda u, g: np.testing.assert_allclose(u, -g, rtol=1e-6), update(small), small)


@functools.cache
def _muon_first_updates(stacked: bool) -> tuple[dict, dict]:
    """(grads, updates) of MUON's first step; stacked grads are the unstacked ones stacked per layer.

    Params are zero so weight decay does not contribute and the update is Muon's / Adam's direction.
    """
    grads = _random_like(_gpt_like_params())
    if stacked:
        grads["blocks"] = _stack(grads["blocks"]["0"], grads["blocks"]["1"])
    return grads, _first_step(MUON)(grads, _zeros_like(grads))


def test_muon_orthogonalizes_hidden_matrices_and_uses_adam_elsewhere() -> None:
    grads, updates = _muon_first_updates(stacked=False)
    # Square hidden kernel: Newton-Schulz pushes all singular values towards 1 (roughly into [0.5, 1.5]).
    kernel = ("blocks", "0", "attn", "c_proj", "kernel")
    sv = np.linalg.svd(_get(updates, kernel) / -LR, compute_uv=False)
    assert sv.min() > 0.5 and sv.max() < 1.5, sv
    raw_sv = np.linalg.svd(_get(grads, kernel), compute_uv=False)
    assert raw_sv.max() / raw_sv.min() > 3  # so the check above is not vacuous
    # First Adam step is -lr * sign(g) (bias-corrected m / sqrt(v)), at the reduced Adam lr.
    adam_lr = LR * MUON.adam_lr_ratio
    for path in [
        ("lm_head", "kernel"),
        ("wte", "embedding"),
        ("ln_f", "scale"),
        ("blocks", "0", "ln_1", "bias"),
    ]:
        np.testing.assert_allclose(_get(updates, path), -adam_lr * np.sign(_get(grads, path)), rtol=1e-5)


def test_muon_treats_stacked_kernels_as_independent_layers() -> None:
    _, unstacked = _muon_first_updates(stacked=False)
    _, stacked = _muon_first_updates(stacked=True)
    for i in range(2):
        jax.tree.map(
            lambda a, b, i=i: np.testing.assert_allclose(a[i], b, rtol=1e-4, atol=1e-7),
            stacked["blocks"],
            unstacked["blocks"][str(i)],
        )
    np.testing.assert_allclose(stacked["lm_head"]["kernel"], unstacked["lm_head"]["kernel"], rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Training behaviour on a tiny token classifier: wte -> hidden (kernel, bias) -> ln -> lm_head.


def _mlp_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)

    def normal(fan_in: int, fan_out: int, scale: float) -> np.ndarray:
        return _f32(scale * rng.standard_normal((fan_in, fan_out)))

    return {
        "wte": {"embedding": normal(V, D, 1.0)},
        "blocks": {"0": {"mlp": {"kernel": normal(D, H, D**-0.5), "bias": _f32(np.zeros(H))}}},
        "ln_f": {"scale": _f32(np.ones(H)), "bias": _f32(np.zeros(H))},
        "lm_head": {"kernel": normal(H, C, H**-0.5)},
    }


Batch = tuple[np.ndarray, np.ndarray]


@jax.jit
def _mlp_loss(params: dict, batch: Batch) -> jax.Array:
    tokens, labels = batch
    x = params["wte"]["embedding"][tokens]
    mlp = params["blocks"]["0"]["mlp"]
    h = jax.nn.gelu(x @ mlp["kernel"] + mlp["bias"])
    h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
    h = h * params["ln_f"]["scale"] + params["ln_f"]["bias"]
    logits = h @ params["lm_head"]["kernel"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _batch(seed: int, n: int) -> Batch:
    tokens = np.random.default_rng(seed).integers(0, V, n)
    labels = (tokens * 7 + 3) % C  # a fixed function of the token, so it is learnable
    return tokens, labels


def _train(tx: optax.GradientTransformation, params: dict, batch: Batch, steps: int) -> dict:
    @jax.jit
    def run(params: dict) -> dict:
        def step(_: int, carry: tuple[dict, optax.OptState]) -> tuple[dict, optax.OptState]:
            params, state = carry
            updates, state = tx.update(jax.grad(_mlp_loss)(params, batch), state, params)
            return optax.apply_updates(params, updates), state

        return jax.lax.fori_loop(0, steps, step, (params, tx.init(params)))[0]

    return run(params)


@pytest.mark.parametrize(
    ("config", "peak_lr"),
    [
        (opt.AdamW(), 1e-2),
        (opt.AdamW(weight_decay=0.0), 1e-2),
        (opt.SGD(momentum=0.9, nesterov=True, weight_decay=1e-4), 0.1),
        (opt.Lion(), 1e-2),
        (opt.Muon(), 0.05),
    ],
    ids=["AdamW", "AdamW-wd0", "SGD", "Lion", "Muon"],
)
def test_optimizers_reduce_loss(config: opt.OptimizerConfig, peak_lr: float) -> None:
    params = _mlp_params(1)
    batch = _batch(2, 64)
    schedule = opt.CosineDecaySchedule(warmup_steps=5, peak_lr=peak_lr, decay_steps=50)
    trained = _train(opt.create_optimizer(config, schedule), params, batch, steps=50)
    before, after = float(_mlp_loss(params, batch)), float(_mlp_loss(trained, batch))
    assert math.isfinite(after)
    assert after < 0.5 * before, (before, after)


def test_grad_accumulation_matches_big_batch() -> None:
    k, micro, n_updates = 3, 4, 3
    params = _mlp_params(3)
    batches = [_batch(10 + i, k * micro) for i in range(n_updates)]
    # Clipping is active on some updates only (so summing instead of averaging would change the result),
    # and the warmup makes a schedule that counts micro-steps differ.
    config = opt.AdamW(clip_gradient_norm=2.5)
    schedule = opt.CosineDecaySchedule(warmup_steps=2, peak_lr=1e-2, decay_steps=4, decay_lr=1e-3)
    grad_fn = jax.jit(jax.grad(_mlp_loss))

    big_tx = opt.create_optimizer(config, schedule)
    big_update = jax.jit(big_tx.update)
    big_params, big_state = params, jax.jit(big_tx.init)(params)
    grad_norms = []
    for batch in batches:
        grads = grad_fn(big_params, batch)
        grad_norms.append(float(optax.tree.norm(grads)))
        updates, big_state = big_update(grads, big_state, big_params)
        big_params = optax.apply_updates(big_params, updates)

    assert min(grad_norms) < config.clip_gradient_norm < max(grad_norms), grad_norms

    acc_tx = opt.create_optimizer(config, schedule)
    acc_update = jax.jit(acc_tx.update)
    acc_params, acc_state = params, jax.jit(acc_tx.init)(params)
    accumulate = jax.jit(lambda p, mb: opt.accumulate_gradients(lambda p, b, i: _mlp_loss(p, b), p, mb))
    for tokens, labels in batches:
        micro_batches = (
            tokens.reshape(k, micro, *tokens.shape[1:]),
            labels.reshape(k, micro, *labels.shape[1:]),
        )
        _, grads = accumulate(acc_params, micro_batches)
        updates, acc_state = acc_update(grads, acc_state, acc_params)
        acc_params = optax.apply_updates(acc_params, updates)

    assert not np.allclose(big_params["lm_head"]["kernel"], params["lm_head"]["kernel"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), acc_params, big_params)


# ---------------------------------------------------------------------------------------------------------
# flax nnx.State params, as produced by the model module.


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.fc = nnx.Linear(D, H, rngs=rngs)


class _TinyModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(V, D, rngs=rngs)
        self.block = _Block(rngs)
        self.lm_head = nnx.Linear(H, V, use_bias=False, rngs=rngs)


def _by_path(tree: nnx.State) -> dict[str, object]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}


def test_nnx_state_params() -> None:
    """Labels and mask on nnx paths (which end in "value"), and Muon steps on an nnx.State."""
    abstract = nnx.state(nnx.eval_shape(lambda: _TinyModel(nnx.Rngs(0))), nnx.Param)
    assert _by_path(opt.default_weight_decay_mask(abstract)) == {
        "block/fc/bias/value": False,
        "block/fc/kernel/value": True,
        "block/ln/bias/value": False,
        "block/ln/scale/value": False,
        "lm_head/kernel/value": True,
        "wte/embedding/value": True,
    }
    labels = _by_path(opt.muon_labels(abstract))
    assert [path for path, label in labels.items() if label == "muon"] == ["block/fc/kernel/value"]

    params = _random_like(abstract)
    tx = opt.create_optimizer(MUON, opt.ConstantSchedule(warmup_steps=0, peak_lr=1e-3))
    update = jax.jit(tx.update)
    state = jax.jit(tx.init)(params)
    for _ in range(2):
        updates, state = update(_random_like(abstract, seed=2), state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    assert all(np.all(np.isfinite(u)) and np.all(u != 0) for u in jax.tree.leaves(updates))


def test_the_output_layer_takes_its_own_learning_rate() -> None:
    """With `head_lr_ratio`, the untied output layer alone is labelled "head" and steps at lr x that ratio:
    its first AdamW update (about lr x ratio per entry) shrinks from adam_lr_ratio's to head_lr_ratio's,
    while the embedding and the hidden matrices step as before."""
    abstract = nnx.state(nnx.eval_shape(lambda: _TinyModel(nnx.Rngs(0))), nnx.Param)
    labels = _by_path(opt.muon_labels(abstract, head=True))
    assert [path for path, label in labels.items() if label == "head"] == ["lm_head/kernel/value"]
    assert labels["wte/embedding/value"] == "adam" and labels["block/fc/kernel/value"] == "muon"

    params, grads = _random_like(abstract), _random_like(abstract, seed=2)
    schedule = opt.ConstantSchedule(warmup_steps=0, peak_lr=1e-2)

    def first_update(muon: opt.Muon) -> dict[str, np.ndarray]:
        tx = opt.create_optimizer(muon, schedule)
        return _by_path(tx.update(grads, tx.init(params), params)[0])

    base = opt.Muon(adam_lr_ratio=3.0, weight_decay=0.0, clip_gradient_norm=float("inf"))
    same, own = first_update(base), first_update(dataclasses.replace(base, head_lr_ratio=1.0))
    mean = lambda u: float(np.mean(np.abs(u)))
    assert mean(same["lm_head/kernel/value"]) == pytest.approx(3e-2, rel=0.05)
    assert mean(own["lm_head/kernel/value"]) == pytest.approx(1e-2, rel=0.05)
    for path in ("wte/embedding/value", "block/fc/kernel/value"):
        np.testing.assert_array_equal(own[path], same[path])


# ---------------------------------------------------------------------------------------------------------
# Validation: bad values fail at construction with a message naming the field.


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: opt.CosineDecaySchedule(peak_lr=-1e-4), r"CosineDecaySchedule\.peak_lr"),
        (lambda: opt.CosineDecaySchedule(decay_lr=-1e-6), r"CosineDecaySchedule\.decay_lr"),
        (
            lambda: opt.CosineDecaySchedule(warmup_steps=2000, decay_steps=1000),
            r"CosineDecaySchedule\.decay_steps",
        ),
        (lambda: opt.CosineDecaySchedule(warmup_steps=-1), r"CosineDecaySchedule\.warmup_steps"),
        (lambda: opt.RsqrtDecaySchedule(peak_lr=0.0), r"RsqrtDecaySchedule\.peak_lr"),
        (lambda: opt.RsqrtDecaySchedule(timescale=0), r"RsqrtDecaySchedule\.timescale"),
        (lambda: opt.WSDSchedule(decay_fraction=0.0), r"WSDSchedule\.decay_fraction"),
        (lambda: opt.WSDSchedule(decay_fraction=1.5), r"WSDSchedule\.decay_fraction"),
        (lambda: opt.WSDSchedule(total_steps=1000, decay_fraction=1e-6), r"WSDSchedule\.decay_fraction"),
        (
            lambda: opt.WSDSchedule(warmup_steps=900, total_steps=1000, decay_fraction=0.2),
            r"WSDSchedule\.warmup_steps",
        ),
        (lambda: opt.WSDSchedule(final_lr_fraction=-0.1), r"WSDSchedule\.final_lr_fraction"),
        (lambda: opt.WSDSchedule(shape="cosine"), r"WSDSchedule\.shape"),
        (lambda: opt.ConstantSchedule(peak_lr=-1.0), r"ConstantSchedule\.peak_lr"),
        (lambda: opt.AdamW(b2=1.0), r"AdamW\.b2 must be in \[0, 1\), got 1\.0"),
        (lambda: opt.AdamW(b1=-0.1), r"AdamW\.b1"),
        (lambda: opt.AdamW(eps=0.0), r"AdamW\.eps"),
        (lambda: opt.AdamW(weight_decay=-0.1), r"AdamW\.weight_decay"),
        (lambda: opt.AdamW(clip_gradient_norm=0.0), r"AdamW\.clip_gradient_norm"),
        (lambda: opt.SGD(clip_gradient_norm=-1.0), r"SGD\.clip_gradient_norm"),
        (lambda: opt.SGD(momentum=1.0), r"SGD\.momentum"),
        (lambda: opt.Lion(b1=1.0), r"Lion\.b1"),
        (lambda: opt.Muon(adam_lr_ratio=0.0), r"Muon\.adam_lr_ratio"),
        (lambda: opt.Muon(head_lr_ratio=-1.0), r"Muon\.head_lr_ratio"),
        (lambda: opt.Muon(momentum=1.0), r"Muon\.momentum"),
        (lambda: opt.Muon(clip_gradient_norm=0.0), r"Muon\.clip_gradient_norm"),
    ],
)
def test_invalid_values_raise(make, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_valid_edge_values_construct() -> None:
    opt.AdamW(b1=0.0, b2=0.999, weight_decay=0.0, clip_gradient_norm=float("inf"))
    opt.WSDSchedule(warmup_steps=0, total_steps=10, decay_fraction=1.0, final_lr_fraction=1.0)
    opt.CosineDecaySchedule(warmup_steps=0, decay_steps=1, decay_lr=2.5e-5)
    assert all(isinstance(c, opt.OptimizerConfig) for c in ALL_OPTIMIZERS)
