"""Measuring and planning: the step benchmark and profiler, and `minigpt plan`'s memory and speed estimate."""
