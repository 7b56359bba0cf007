"""minigpt: pretrain GPT-style language models with JAX, Flax NNX, Optax, Grain and Orbax."""

__version__ = "0.1.0"
