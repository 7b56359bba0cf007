"""The network: the Flax NNX transformer and its pieces (attention, rotary positions, the chunked output
layer's loss, mixed-precision products, dropout, LoRA adapters). Every parameter names its logical axes."""
