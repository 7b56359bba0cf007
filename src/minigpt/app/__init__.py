"""The application: a training run (open or resume its directory, the loop and its hooks), `--init-from`'s
starting weights, and `minigpt check`'s verification of a run."""
