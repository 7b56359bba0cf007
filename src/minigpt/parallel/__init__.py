"""Meshes and processes: device meshes, the FSDP and tensor-parallel shardings of logical axes, global batches,
and joining a multi-process run through `jax.distributed`."""
