"""Optimizers and learning-rate schedules as frozen configs whose `create()` returns optax objects, Muon's
batched orthogonalisation, and gradient accumulation."""
