"""Training: the device mesh across hosts, TrainState and the pure step, Orbax checkpoints, run directories, metrics and the loop."""
