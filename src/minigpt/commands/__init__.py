"""The `minigpt` command line: one module per command (its flags and its body), and the flag plumbing they
share (`flags`). `minigpt.cli` dispatches to them."""
