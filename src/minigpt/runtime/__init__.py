"""The process's plumbing, under everything else: one-line errors and warnings, atomic files and the run lock,
Ctrl-C, malloc's settings, the compilation cache and the compiler process, the watching parent of a
multi-process run, and what the command writes to stderr."""
