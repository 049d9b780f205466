"""The HLO reading behind the breakdown, on hand-written compiled-HLO text (no libtpu)."""

import pytest

from end_to_end.aot import hlo_ops

HLO = """HloModule jit_step

%fused_dot (param_0: bf16[4,64,32], param_1: s32[], param_2: bf16[16,64]) -> bf16[16,32] {
  %param_0 = bf16[4,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant.0 = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,64,32]{2,1,0} dynamic-slice(%param_0, %param_1, %constant.0, %constant.0), dynamic_slice_sizes={1,64,32}
  %bitcast.1 = bf16[64,32]{1,0} bitcast(%dynamic-slice.1)
  %param_2 = bf16[16,64]{1,0} parameter(2)
  ROOT %convolution.1 = bf16[16,32]{1,0} convolution(%param_2, %bitcast.1), dim_labels=bf_io->bf, metadata={op_name="jit(step)/dot_general"}
}

%fused_int8 (param_0.1: s8[8,64], param_1.1: s8[64,32]) -> s32[8,32] {
  %param_0.1 = s8[8,64]{1,0} parameter(0)
  %param_1.1 = s8[64,32]{1,0} parameter(1)
  ROOT %dot.1 = s32[8,32]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[4,64,32], i: s32[], x: bf16[16,64], a: s8[8,64], b: s8[64,32]) -> bf16[16,32] {
  %w = bf16[4,64,32]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[16,64]{1,0:T(8,128)S(1)} parameter(2)
  %a = s8[8,64]{1,0} parameter(3)
  %b = s8[64,32]{1,0} parameter(4)
  %fusion.9 = s32[8,32]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_int8
  ROOT %fusion.1 = bf16[16,32]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/while/body/dot_general"}, backend_config={"flag_configs":[],"estimated_cycles":"100"}
}
"""


def test_parse_reads_instructions_attributes_and_the_entry():
  module = hlo_ops.parse_module(HLO)
  assert module.entry == "main"
  fusion = module.symbols("main")["fusion.1"]
  assert (fusion.opcode, fusion.operands, fusion.attribute("calls")) == ("fusion", ("w", "i", "x"), "fused_dot")
  assert fusion.estimated_cycles == 100 and fusion.op_name == "jit(step)/while/body/dot_general"
  assert module.symbols("fused_dot")["param_1"].arguments == "1"
  assert module.fused_ops("fused_dot") >= {"dynamic-slice", "convolution", "parameter"}
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo_ops.parse_module("%f (a: f32[]) -> f32[] {\n}\n")


def test_bytes_count_hbm_arrays_only():
  assert hlo_ops.hbm_bytes("bf16[16,32]{1,0}") == 1024
  assert hlo_ops.hbm_bytes("(f32[2]{0}, s8[4]{0:T(1024)S(1)}, u32[]{:S(2)})") == 8  # VMEM / sync flags: none
  assert hlo_ops.hbm_bytes("s4[8]{0}") == 4


def test_matmul_flops_from_convolutions_and_dots():
  module = hlo_ops.parse_module(HLO)
  assert hlo_ops.matmul_flops(module, "fused_dot") == (2 * 16 * 32 * 64, False)
  assert hlo_ops.matmul_flops(module, "fused_int8") == (2 * 8 * 32 * 64, True)


def test_a_sliced_stack_counts_the_slice_and_vmem_operands_count_nothing():
  """The fusion reads one [64, 32] slice of the [4, 64, 32] weights, the s32 index, and x from VMEM."""
  module = hlo_ops.parse_module(HLO)
  symbols = module.symbols("main")
  assert hlo_ops.operand_bytes(module, symbols["fusion.1"], symbols) == 64 * 32 * 2 + 4


def _convolution(lhs: str, rhs: str, out: str, attributes: str) -> tuple[hlo_ops.Instruction, dict]:
  text = f"""HloModule m

ENTRY %main (a: {lhs}, b: {rhs}) -> {out} {{
  %a = {lhs} parameter(0)
  %b = {rhs} parameter(1)
  ROOT %convolution.1 = {out} convolution(%a, %b), {attributes}
}}
"""
  module = hlo_ops.parse_module(text)
  symbols = module.symbols("main")
  return symbols["convolution.1"], symbols


def test_a_dot_written_as_a_padded_window_counts_one_tap_per_output():
  """XLA:TPU's form of `btI,NIH->btNH` (14B 720p q projection): the window spans the 40 heads,
  padded by 39 on both sides, so each output meets one real input; the FLOPs are the dot's."""
  op, symbols = _convolution(
      "bf16[2,9450,5120,1]", "bf16[40,5120,128,1]", "f32[2,9450,40,128]",
      'window={size=1x40 pad=0_0x39_39 rhs_reversal=0x1}, dim_labels=0bf1_1io0->0b1f, metadata={op_name="x"}')
  assert hlo_ops.instruction_flops(op, symbols) == 2 * 2 * 9450 * 5120 * 40 * 128


def test_a_padded_strided_convolution_counts_the_taps_on_real_input():
  """A 3-tap conv over 8 positions padded 1 each side: 8 outputs x 3 taps less the 2 on padding;
  with stride 2 (4 outputs): 12 taps less the 1 on the low padding."""
  op, symbols = _convolution("f32[1,8,4]", "f32[3,4,6]", "f32[1,8,6]",
                             "window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f")
  assert hlo_ops.instruction_flops(op, symbols) == 2 * 6 * 4 * (8 * 3 - 2)
  op, symbols = _convolution("f32[1,8,4]", "f32[3,4,6]", "f32[1,4,6]",
                             "window={size=3 stride=2 pad=1_1}, dim_labels=b0f_0io->b0f")
  assert hlo_ops.instruction_flops(op, symbols) == 2 * 6 * 4 * (4 * 3 - 1)
  op, symbols = _convolution("f32[1,3,4]", "f32[2,4,6]", "f32[1,6,6]",  # lhs_dilate 2: inputs at 0, 2, 4
                             "window={size=2 pad=1_1 lhs_dilate=2}, dim_labels=b0f_0io->b0f")
  assert hlo_ops.instruction_flops(op, symbols) == 2 * 6 * 4 * 6
