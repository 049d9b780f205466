"""The Pallas kernel model on a hand-written Mosaic module (the shape of a compiled kernel's MLIR)."""

import pytest

from end_to_end.aot import kernel_model

# Grid (2, 3, 4): q / out blocks follow axes 0-1 (copied 2 x 3 times), k follows axes 0 and 2 (every
# step), the scale follows none (once). Two P V products with one signature (alternative paths) and
# one Q K^T.
KERNEL = """module attributes {stable_mosaic.version = 15 : i64} {
  func.func @attend(%arg0: i32, %arg1: i32, %arg2: i32, %arg3: memref<1xi32, #tpu.memory_space<smem>>, %arg4: memref<1x128x64xbf16, #tpu.memory_space<vmem>>, %arg5: memref<1x256x64xbf16, #tpu.memory_space<vmem>>, %arg6: memref<8x128xf32, #tpu.memory_space<vmem>>, %arg7: memref<1x128x64xbf16, #tpu.memory_space<vmem>>, %arg8: memref<128x64xf32, #tpu.memory_space<vmem>>) attributes {dimension_semantics = [#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<arbitrary>], iteration_bounds = array<i64: 2, 3, 4>, scalar_prefetch = 1 : i64, scratch_operands = 1 : i64, tpu.core_type = #tpu.core_type<tc>, window_params = [{transform_indices = @transform_0, window_bounds = array<i64: 1, 128, 64>}, {transform_indices = @transform_1, window_bounds = array<i64: 1, 256, 64>}, {transform_indices = @transform_2, window_bounds = array<i64: 8, 128>}, {transform_indices = @transform_3, window_bounds = array<i64: 1, 128, 64>}]} {
    %10 = tpu.matmul %5, %7, %cst {dimension_numbers = #tpu.dot_dimension_numbers<[1], [1], [0], [0], [0, 0, 1, 0], [], []>, transpose_lhs_hint = false} : vector<128x64xbf16>, vector<256x64xbf16>, vector<128x256xf32> -> vector<128x256xf32>
    scf.if %27 {
      %49 = tpu.matmul %48, %9, %cst_32 {dimension_numbers = #tpu.dot_dimension_numbers<[1], [0], [0], [1], [0, 0, 1, 1], [], []>, transpose_lhs_hint = false} : vector<128x256xbf16>, vector<256x64xbf16>, vector<128x64xf32> -> vector<128x64xf32>
    }
    scf.if %31 {
      %64 = tpu.matmul %63, %9, %cst_35 {dimension_numbers = #tpu.dot_dimension_numbers<[1], [0], [0], [1], [0, 0, 1, 1], [], []>, transpose_lhs_hint = false} : vector<128x256xbf16>, vector<256x64xbf16>, vector<128x64xf32> -> vector<128x64xf32>
    }
    return
  }
  func.func @transform_0(%arg0: i32, %arg1: i32, %arg2: i32, %arg3: memref<1xi32, #tpu.memory_space<smem>>) -> (i32, i32, i32) {
    %c0_i32 = arith.constant 0 : i32
    return %arg0, %arg1, %c0_i32 : i32, i32, i32
  }
  func.func @transform_1(%arg0: i32, %arg1: i32, %arg2: i32, %arg3: memref<1xi32, #tpu.memory_space<smem>>) -> (i32, i32, i32) {
    %c0_i32 = arith.constant 0 : i32
    %0 = arith.addi %arg2, %arg0 : i32
    return %arg0, %0, %c0_i32 : i32, i32, i32
  }
  func.func @transform_2(%arg0: i32, %arg1: i32, %arg2: i32, %arg3: memref<1xi32, #tpu.memory_space<smem>>) -> (i32, i32) {
    %c0_i32 = arith.constant 0 : i32
    return %c0_i32, %c0_i32 : i32, i32
  }
  func.func @transform_3(%arg0: i32, %arg1: i32, %arg2: i32, %arg3: memref<1xi32, #tpu.memory_space<smem>>) -> (i32, i32, i32) {
    %c0_i32 = arith.constant 0 : i32
    return %arg0, %arg1, %c0_i32 : i32, i32, i32
  }
}
"""


def test_grid_blocks_and_matmuls_give_flops_and_bytes():
  cost = kernel_model.kernel_cost(KERNEL)
  assert (cost.name, cost.grid, cost.int8) == ("attend", (2, 3, 4), False)
  step = 2 * 128 * 256 * 64 + 2 * 128 * 64 * 256  # Q K^T, and P V once (its two paths are one signature)
  assert cost.flops == 24 * step
  block = 128 * 64 * 2
  assert cost.bytes == block * 6 + 256 * 64 * 2 * 24 + 8 * 128 * 4 * 1 + block * 6


def test_the_modelled_time_is_the_larger_roofline():
  cost = kernel_model.KernelCost("k", (1,), flops=1000.0, bytes=300.0)
  assert cost.cycles(flops_per_cycle=10.0, bytes_per_cycle=1.0) == (300.0, "HBM")
  assert cost.cycles(flops_per_cycle=1.0, bytes_per_cycle=1.0) == (1000.0, "MXU")


def test_a_module_without_a_grid_is_refused():
  with pytest.raises(ValueError, match="iteration_bounds"):
    kernel_model.kernel_cost("module {\n  func.func @f(%arg0: i32) {\n    return\n  }\n}\n")


def test_a_kernel_lowered_for_tpu_decodes_to_its_grid():
  """A real serialized kernel (a Pallas matmul lowered for TPU on this CPU host, no libtpu): the
  body in the custom call decodes and models to its grid, blocks and matmul."""
  import re

  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  def f(x, y):
    return pl.pallas_call(kernel, grid=(2,), in_specs=[pl.BlockSpec((128, 128), lambda i: (i, 0)),
                                                       pl.BlockSpec((128, 128), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((256, 128), jnp.float32))(x, y)

  args = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 128), jnp.bfloat16)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  body = re.search(r"\\22body\\22: \\22([^\\]*)\\22", text).group(1)
  cost = kernel_model.kernel_cost(kernel_model.mosaic_text(body))
  assert cost.grid == (2,)
  assert cost.flops == 2 * (2 * 128 * 128 * 128)
  assert cost.bytes == 128 * 128 * 2 * 2 + 128 * 128 * 2 * 1 + 128 * 128 * 4 * 2
