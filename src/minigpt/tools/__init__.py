"""Measuring and planning: `minigpt bench` and `profile`, `minigpt plan`'s report with XLA's figure, and a
compiled program's matrix products."""
