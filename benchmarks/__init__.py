"""minigpt's benchmarks, each a script that writes its results as JSON, and a runner that runs them and
renders docs/results.md from the JSON:

    python -m benchmarks                      # every benchmark at full size; JSON into benchmarks/results/
    python -m benchmarks --quick              # tiny shapes, a step or two each: checks they all still run
    python -m benchmarks bench_seed plan_check

Peers (the seed tutorial, lm-eval's hf backend, transformers) run in the same benchmark as minigpt, side by
side, so a comparison never mixes machines or days.
"""

# In the order the results page shows them; each is benchmarks/NAME.py.
BENCHMARKS = (
    "time_to_quality",
    "bench_speed",
    "bench_accelerator",
    "bench_precision",
    "bench_dots",
    "bench_seed",
    "bench_memory",
    "bench_generate",
    "bench_lm_eval",
    "bench_serve",
    "bench_sft",
    "bench_continue",
    "bench_data",
    "bench_startup",
    "bench_checkpoint",
    "compare_optimizers",
    "plan_check",
)
