"""Training's parts below the loop: TrainState and the pure train and eval steps, the memory plan of a step,
the machine's peak, dtype and memory, Orbax checkpoints, metrics, profiler windows, and trained runs."""
