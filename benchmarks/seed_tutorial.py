"""The Flax NNX miniGPT tutorial this project was seeded from (../shared/seeds/002_*.txt; upstream
docs_nnx/examples/minigpt.md), as written there, flaws included, for the benchmarks that compare minigpt with
it: its model, data pipeline, loss and train step (bench_seed.py) and its generation loop (bench_generate.py).

Left out: the sharding metadata and the mesh (on one CPU device they would do nothing), pandas (its DataFrame
round trip returns the same list) and the tokenizer's download (callers set `tokenizer` from local files).
Module-level settings are the tutorial's globals; callers may change them (e.g. `maxlen` for a quick run).
"""

from dataclasses import dataclass

import grain.python as pygrain
import jax
import jax.numpy as jnp
import optax
from flax import nnx

tokenizer = None  # tiktoken.get_encoding("gpt2") in the tutorial; set by the caller from local files
maxlen = 256
embed_dim = 256
num_heads = 8
feed_forward_dim = 256
num_epochs = 1
top_k = 10


class TransformerBlock(nnx.Module):
    """A single Transformer block: self-attention and a feed-forward network, each followed by dropout, a
    residual add and LayerNorm (post-norm)."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs),
            nnx.relu,
            nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    """Token embeddings plus learned position embeddings."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x)  # the tutorial adds out_sharding=jax.typeof(x).sharding
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    """The tutorial's miniGPT (its generation methods are the functions at the end, taking the model)."""

    def __init__(
        self,
        maxlen: int,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        feed_forward_dim: int,
        num_transformer_blocks: int,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(
            *[
                TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                for _ in range(num_transformer_blocks)
            ]
        )
        self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size, rngs=rngs)

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x)
        return self.output_layer(x)  # the tutorial reshards this to the inputs' sharding


def create_model(rngs):
    return MiniGPT(
        maxlen, tokenizer.n_vocab, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks=4, rngs=rngs
    )


@dataclass
class TextDataset:
    data: list
    maxlen: int

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx: int):
        # Use Tiktoken for tokenization
        encoding = tokenizer.encode(self.data[idx], allowed_special={"<|endoftext|>"})[: self.maxlen]
        return encoding + [0] * (self.maxlen - len(encoding))  # Pad to maxlen


def load_and_preprocess_data(file_path, batch_size, maxlen):
    with open(file_path) as f:
        text = f.read()
    stories = text.split("<|endoftext|>")
    stories = [story + "<|endoftext|>" for story in stories if story.strip()]
    data = stories  # the tutorial: pd.DataFrame({"text": stories})["text"].dropna().tolist(), the same list
    dataset = TextDataset(data, maxlen)
    sampler = pygrain.IndexSampler(
        len(dataset), shuffle=False, seed=42, shard_options=pygrain.NoSharding(), num_epochs=num_epochs
    )
    dl = pygrain.DataLoader(
        data_source=dataset,
        sampler=sampler,
        operations=[pygrain.Batch(batch_size=batch_size, drop_remainder=True)],
    )
    return dl


def loss_fn(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


@nnx.jit(donate_argnums=(0, 1, 3))
def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, lables=batch[1])  # sic
    optimizer.update(model, grads)


# The tutorial's MiniGPT.sample_from / generate_step / generate_text, with `self` as the `model` argument so
# that they drive minigpt's model too, and `generate_text` returning the ids it would decode.


def sample_from(logits):
    logits, indices = jax.lax.top_k(logits, k=top_k)
    logits = nnx.softmax(logits)
    return jax.random.choice(jax.random.PRNGKey(0), indices, p=logits)


@nnx.jit(donate_argnums=(1,))
def generate_step(model, padded_tokens, sample_index):
    logits = model(padded_tokens)
    next_token = sample_from(logits[0][sample_index])
    return next_token


def generate_text(model, max_tokens, start_tokens, eot_id):
    generated = []
    for _ in range(max_tokens):
        sample_index = len(start_tokens) + len(generated) - 1
        padded_tokens = jnp.array(
            start_tokens + generated + [0] * (maxlen - len(start_tokens) - len(generated))
        )[None, :]
        next_token = int(generate_step(model, padded_tokens, sample_index))
        if next_token == eot_id:  # the tutorial: tokenizer.encode("<|endoftext|>", ...)[0]
            break
        generated.append(next_token)
    return start_tokens + generated
