"""Causal attention on a TPU through JAX's own Pallas kernel, splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`): the scores are computed block by block in the chip's
vector memory with an online softmax, so the (T, S) scores and probabilities never reach HBM, and blocks above
the diagonal are skipped rather than masked.

The kernel works on one sequence's (heads, T, H) arrays and takes grouped key/value heads as they are, so the
batch is vmapped and, on a mesh of several devices, each device runs it on its own shard (`shard_map`: a
Pallas kernel is not split by XLA's partitioner). On other platforms (tests) it runs in Pallas's interpreter.

Shapes: B batch, T queries, S keys (= T), N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from minigpt.parallel import sharding

LONG = 512
"""auto's least sequence length for splash on a TPU: below it XLA's attention keeps the (T, T) scores in
memory and runs faster."""
BLOCKS = (512, 256, 128)
"""Block lengths tried, largest first: the kernel's tiles of queries and keys, which must divide T."""


def block(T: int) -> int | None:
    """The tile length for sequences of T tokens, or None where no tile divides T (the kernel cannot run)."""
    return next((b for b in BLOCKS if T % b == 0), None)


def supported(T: int) -> bool:
    """Whether splash attention can run sequences of T tokens."""
    return block(T) is not None


@functools.cache
def _kernel(n_heads: int, T: int, interpret: bool) -> splash.SplashAttentionKernel:
    """The kernel for `n_heads` query heads over T causal positions (its block mask is built once, in numpy)."""
    b = block(T)
    mask = splash.MultiHeadMask([splash.CausalMask((T, T)) for _ in range(n_heads)])
    sizes = splash.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        use_fused_bwd_kernel=True,  # dq, dk and dv from one recomputation of the scores, not two
    )
    with jax.ensure_compile_time_eval():  # first made while a step is traced: its arrays must be concrete
        kernel = splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
    # Its block masks as numpy, so they are the program's literals: as jax arrays they would be constants an
    # ahead-of-time compiled step takes as extra arguments, which its call does not pass on a TPU.
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        setattr(kernel, name, jax.tree.map(np.asarray, getattr(kernel, name)))
    return kernel


def _local(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """One device's share: the kernel vmapped over its rows, heads moved before time and back. The program
    holds the kernel for a TPU and its interpreted form for other platforms (one of them is lowered: a step
    exported for a TPU from a CPU carries the TPU's kernel)."""
    _, T, N, H = q_BTNH.shape
    q_BNTH = jnp.swapaxes(q_BTNH * jnp.asarray(H**-0.5, q_BTNH.dtype), 1, 2)
    k_BKTH, v_BKTH = jnp.swapaxes(k_BTKH, 1, 2), jnp.swapaxes(v_BTKH, 1, 2)

    def run(interpret: bool) -> Callable[..., jax.Array]:
        return lambda *qkv: jax.vmap(_kernel(N, T, interpret))(*qkv)

    y_BNTH = jax.lax.platform_dependent(q_BNTH, k_BKTH, v_BKTH, tpu=run(False), default=run(True))
    return jnp.swapaxes(y_BNTH, 1, 2)


def attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(H), causal) v in the inputs' dtype, as `jax.nn.dot_product_attention(...,
    is_causal=True)` computes it; rows split over the mesh's data and FSDP axes, heads over its tensor axis."""
    mesh = sharding.active_mesh()
    if mesh is None or mesh.size == 1:
        return _local(q_BTNH, k_BTKH, v_BTKH)
    spec = PartitionSpec(sharding.BATCH_AXES, None, sharding.TENSOR_AXIS, None)
    return jax.shard_map(_local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(
        q_BTNH, k_BTKH, v_BTKH
    )
