"""Where a compiled step's device time goes: ops filed by the named scope of the code they came from
(attention, the loss, the optimizer), the rest as matrix products or other work."""

from __future__ import annotations

import dataclasses

from minigpt.config import get_preset
from minigpt.tools.bench import bench_config, compile_step
from minigpt.tools.breakdown import CATEGORIES, breakdown, op_categories

# The shape of a TPU program's text: a Pallas kernel's custom call whose attributes run over several lines
# (its op_name after them), a fusion that calls a computation holding a product, and a loop holding others.
HLO = """HloModule jit_train_step, entry_computation_layout={()->()}

%fused_computation.1 (p0: bf16[8,8], p1: bf16[8,8]) -> f32[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %convolution.1 = f32[8,8]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf, metadata={op_name="jit(train_step)/jvp(GPT)/dot_general"}
}

%fused_computation.2 (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %exponential.1 = f32[8]{0} exponential(%p0), metadata={op_name="jit(train_step)/transpose(jvp(loss))/exp"}
}

ENTRY %main.1 () -> () {
  %splash_mha_fwd_residuals.3 = (bf16[4,8,8]) custom-call(%a, %b), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="jit(train_step)/jvp(attention)/pallas_call"}
  %fusion.7 = f32[8,8]{1,0} fusion(%x, %y), kind=kOutput, calls=%fused_computation.1
  %fusion.8 = f32[8]{0} fusion(%z), kind=kLoop, calls=%fused_computation.2
  %add.3 = f32[8]{0} add(%z, %z), metadata={op_name="jit(train_step)/optimizer/add"}
  %copy.4 = f32[8]{0} copy(%z), metadata={op_name="jit(train_step)/jvp(GPT)/copy"}
}
"""


def test_ops_are_filed_by_the_scope_of_the_code_they_came_from() -> None:
    assert op_categories(HLO) == {
        "p0": "other",
        "p1": "other",
        "convolution.1": "matmul",
        "exponential.1": "loss",
        "splash_mha_fwd_residuals.3": "attention",
        "fusion.7": "matmul",
        "fusion.8": "loss",
        "add.3": "optimizer",
        "copy.4": "other",
    }


def test_a_real_steps_time_splits_over_every_category() -> None:
    cpu = get_preset("cpu")
    model = dataclasses.replace(cpu.model, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32)
    data = dataclasses.replace(cpu.data, seq_len=32)
    cfg = bench_config(dataclasses.replace(cpu, model=model, data=data, batch_size=2), 512)
    step = compile_step(cfg)
    found = breakdown(step.xla, step, steps=2)
    assert set(found.seconds) == set(CATEGORIES)
    assert all(found.seconds[c] > 0 for c in ("attention", "loss", "optimizer", "matmul")), found.seconds
    assert found.idle_s is None  # a CPU's ops overlap on its threads: no device timeline to find gaps in
    assert found.top and all(category in CATEGORIES for _, category, _ in found.top)
