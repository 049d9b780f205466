"""The modelled-time breakdown on a hand-written compiled step: a 3-trip block loop holding a
matmul, a relayout on each side of an all-to-all, a norm, a Pallas kernel and an add; one op outside
the loop. No libtpu: the kernel's cost is given."""

import pytest

from end_to_end.aot import breakdown, kernel_model
from end_to_end.aot import stages as aot_stages
from end_to_end.bench import pipeline as bench_pipeline

HLO = """HloModule jit_step

%fused_dot (param_0: bf16[4,64,32], param_1: s32[], param_2: bf16[16,64]) -> bf16[16,32] {
  %param_0 = bf16[4,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant.0 = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,64,32]{2,1,0} dynamic-slice(%param_0, %param_1, %constant.0, %constant.0), dynamic_slice_sizes={1,64,32}
  %bitcast.1 = bf16[64,32]{1,0} bitcast(%dynamic-slice.1)
  %param_2 = bf16[16,64]{1,0} parameter(2)
  ROOT %convolution.1 = bf16[16,32]{1,0} convolution(%param_2, %bitcast.1), dim_labels=bf_io->bf
}

%fused_norm (param_0.1: bf16[32,16]) -> f32[32,16] {
  %param_0.1 = bf16[32,16]{1,0} parameter(0)
  %convert.1 = f32[32,16]{1,0} convert(%param_0.1)
  ROOT %rsqrt.1 = f32[32,16]{1,0} rsqrt(%convert.1)
}

%body (p: (s32[], bf16[16,64], bf16[4,64,32])) -> (s32[], bf16[16,64], bf16[4,64,32]) {
  %p = (s32[], bf16[16,64]{1,0}, bf16[4,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[16,64]{1,0} get-tuple-element(%p), index=1
  %w = bf16[4,64,32]{2,1,0} get-tuple-element(%p), index=2
  %fusion.1 = bf16[16,32]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/while/body/dot_general"}, backend_config={"estimated_cycles":"100"}
  %copy.1 = bf16[16,32]{0,1} copy(%fusion.1), metadata={op_name="jit(step)/while/body/jit(_usp)/transpose"}, backend_config={"estimated_cycles":"40"}
  %all-to-all.1 = bf16[16,32]{0,1} all-to-all(%copy.1), replica_groups={{0,1,2,3}}, dimensions={0}
  %bitcast.2 = bf16[32,16]{1,0} bitcast(%all-to-all.1)
  %copy.2 = bf16[32,16]{0,1} copy(%bitcast.2), backend_config={"estimated_cycles":"30"}
  %fusion.2 = f32[32,16]{1,0:S(1)} fusion(%copy.2), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/while/body/jit(rmsnorm_rope)/rsqrt"}, backend_config={"estimated_cycles":"20"}
  %attend.1 = bf16[16,32]{1,0} custom-call(%fusion.2), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"KERNEL"}}
  %add.1 = bf16[16,32]{1,0} add(%attend.1, %attend.1), backend_config={"estimated_cycles":"5"}
  ROOT %tuple.1 = (s32[], bf16[16,64]{1,0}, bf16[4,64,32]{2,1,0}) tuple(%i, %x, %w)
}

%cond (p.1: (s32[], bf16[16,64], bf16[4,64,32])) -> pred[] {
  %p.1 = (s32[], bf16[16,64]{1,0}, bf16[4,64,32]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %constant.3 = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %constant.3), direction=LT
}

ENTRY %main (a: bf16[16,64], w: bf16[4,64,32]) -> bf16[16,64] {
  %a = bf16[16,64]{1,0} parameter(0)
  %w.0 = bf16[4,64,32]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %tuple.0 = (s32[], bf16[16,64]{1,0}, bf16[4,64,32]{2,1,0}) tuple(%zero, %a, %w.0)
  %while.1 = (s32[], bf16[16,64]{1,0}, bf16[4,64,32]{2,1,0}) while(%tuple.0), condition=%cond, body=%body
  ROOT %negate.1 = bf16[16,64]{1,0} negate(%a), backend_config={"estimated_cycles":"7"}
}
"""
V6E = breakdown.CHIPS["TPU v6 lite"]
KERNEL = kernel_model.KernelCost("attend", (2, 3), flops=V6E.flops_per_cycle() * 50, bytes=V6E.hbm_per_cycle * 20)


def _analyse():
  return breakdown.analyse(HLO, "TPU v6 lite", devices=4, kernel_cost=lambda body: KERNEL)


def test_each_op_lands_in_its_class():
  result = _analyse()
  assert result["blocks"] == 3
  classes = result["block"]["classes"]
  expected = {"matmul": 100, "collective layout": 40 + 30, "norm/RoPE": 20, "elementwise": 5}
  assert {c: r["estimated"] for c, r in classes.items() if r["estimated"]} == expected
  assert classes["Pallas kernels"]["modelled"] == pytest.approx(50)  # MXU-bound: 50 > 20
  a2a = 3 / 4 * 16 * 32 * 2 / V6E.ici_per_cycle  # (D - 1) / D of the buffer at one direction's ICI
  assert classes["collectives"]["modelled"] == pytest.approx(a2a)


def test_rooflines_flops_and_bytes():
  classes = _analyse()["block"]["classes"]
  moved = 64 * 32 * 2 + 4 + 16 * 64 * 2 + 16 * 32 * 2  # the weights' slice, the index, x, the output
  assert classes["matmul"]["bytes"] == moved
  assert classes["matmul"]["flops"] == 2 * 16 * 32 * 64
  assert classes["matmul"]["roofline"] == pytest.approx(max(2 * 16 * 32 * 64 / V6E.flops_per_cycle(),
                                                            moved / V6E.hbm_per_cycle))
  assert classes["norm/RoPE"]["bytes"] == 32 * 16 * 2  # its f32 output stays in VMEM (S(1))


def test_the_step_is_the_block_times_its_trips_plus_the_rest_and_mfu_follows():
  result = _analyse()
  block, step = result["block"], result["step"]
  assert step["total"]["estimated"] == 3 * block["total"]["estimated"] + 7
  assert block["total"]["estimated"] == 195
  ideal = (2 * 16 * 32 * 64 + KERNEL.flops) / V6E.flops_per_cycle()
  assert block["mfu"] == pytest.approx(ideal / block["total"]["modelled"])
  text = breakdown.format_breakdown(result)
  assert "one block (x3)" in text and "modelled MFU" in text and "attend grid 2x3, MXU-bound" in text


def test_a_program_without_a_block_loop_is_reported_whole(capsys):
  """`loop=False` (the VAE decoder's programs): no block table, the whole program with its loop's
  ops counted by their trips (the same total as the step's), the largest ops weighed by their runs."""
  whole = breakdown.analyse(HLO, "TPU v6 lite", devices=4, kernel_cost=lambda body: KERNEL,
                            program="decode later-chunk program", loop=False)
  assert whole["blocks"] == 0 and whole["step"]["total"] == _analyse()["step"]["total"]
  text = breakdown.format_breakdown(whole)
  assert "one block" not in text and "whole decode later-chunk program" in text
  assert "(x3 runs)" in text  # the loop's ops, listed with their trips
  row = dict(vae="wan2.1", height=480, width=832, split=False, devices=1, program="later", compile_s=1.0,
             compile_cpu_s=1.0, convolutions=42, distinct_convolutions=10, collectives={}, cache="off")
  line = aot_stages.format_decode_row(row)
  aot_stages.print_row(line, row)
  assert capsys.readouterr().out == f"{line}\n"  # no breakdown asked for
  aot_stages.print_row(line, dict(row, breakdown=whole))
  assert capsys.readouterr().out == f"{line}\n{text}\n"  # the table after the row


def test_an_unknown_chip_is_refused_and_breakdown_needs_the_step_or_decode():
  with pytest.raises(ValueError, match="no roofline for device kind 'TPU v4'"):
    breakdown.analyse(HLO, "TPU v4", devices=4)
  assert bench_pipeline.main(["--breakdown"]) == 2
  assert bench_pipeline.main(["--aot", "v6e:2x4", "--stages", "text", "--breakdown"]) == 2
