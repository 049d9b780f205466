"""A Pallas TPU kernel's modelled work, from its grid and blocks as the compiled HLO holds them.

libtpu's cost model writes no `estimated_cycles` for a Pallas (Mosaic) kernel: its custom call
carries the kernel as serialized MLIR in `backend_config.custom_call_config.body`. That module
holds what a model needs (`mosaic_text` decodes it): the grid (`iteration_bounds`), each operand's
block (`window_params`: block shape and the index map `@transform_k`) and the kernel body, whose
`tpu.matmul` ops give the MXU work of one grid step. `kernel_cost` turns them into

- FLOPs: the grid steps x the matmul FLOPs of one step, each distinct matmul (same shapes and
  dimension numbers) counted once: a kernel's alternative paths (e.g. the fixed-m kernel's plain
  and rescaling P V products, in two exclusive `scf.if`s) run one per step. Padding is included:
  it is what the kernel executes.
- HBM bytes: each block copied in (or out) once per change of its block index. Pallas skips the
  copy when consecutive grid steps map to the same block, so a block whose index map reads grid
  axes A is copied prod(grid[:j + 1]) times, j the innermost axis of A longer than 1.

The modelled time (`KernelCost.cycles`) is the larger of the FLOPs at the chip's MXU peak and the
bytes at its HBM bandwidth: a roofline, without the per-grid-step overhead or the VPU / EUP work
(the softmax's exp) that a measured kernel also pays.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import re

_MEMREF = re.compile(r"memref<((?:\d+x)*)([a-z]+\d*)")
_ELEMENT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1, "i16": 2, "i1": 1, "f8E4M3FN": 1,
                  "f8E5M2": 1, "f64": 8, "i64": 8}


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One Pallas kernel call's modelled work (see the module docstring).

  Attributes:
    name: the kernel function's name (e.g. "attend_auto").
    grid: the iteration bounds.
    flops: MXU FLOPs of the whole call.
    bytes: HBM bytes of its block copies.
    int8: its matmuls multiply int8 by int8.
  """
  name: str
  grid: tuple[int, ...]
  flops: float
  bytes: float
  int8: bool = False

  def cycles(self, flops_per_cycle: float, bytes_per_cycle: float) -> tuple[float, str]:
    """(modelled cycles, "MXU" or "HBM": which roofline bounds it)."""
    mxu, hbm = self.flops / flops_per_cycle, self.bytes / bytes_per_cycle
    return (mxu, "MXU") if mxu >= hbm else (hbm, "HBM")


def mosaic_text(body: str) -> str:
  """The MLIR text of a `tpu_custom_call`'s serialized kernel (the base64 `body` of its
  backend config). Needs jaxlib's Mosaic dialect (no TPU, no libtpu)."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.tpu_custom_call import PassManager, tpu

  context = mlir.make_ir_context()
  tpu.register_dialect(context)
  with context, ir.Location.unknown():
    context.allow_unregistered_dialects = True
    module = ir.Module.parse(base64.b64decode(body))
    PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
    return str(module)


def _functions(text: str) -> dict[str, tuple[str, str]]:
  """name -> (signature line, body text) of every func.func in the module text."""
  parts = re.split(r"^\s*func\.func (?:private )?@", text, flags=re.M)[1:]
  out = {}
  for part in parts:
    name = part.split("(", 1)[0]
    signature, _, body = part.partition("\n")
    out[name] = (signature, body)
  return out


def _int_array(signature: str, key: str) -> tuple[int, ...]:
  m = re.search(rf"{key} = array<i64(?:: ([\d, -]+))?>", signature)
  return tuple(int(v) for v in m.group(1).split(",")) if m and m.group(1) else ()


def _matmul_step_flops(body: str) -> tuple[float, bool]:
  """(FLOPs, int8) of one grid step: each distinct `tpu.matmul` once."""
  seen, flops, types = set(), 0.0, set()
  for m in re.finditer(r"tpu\.matmul [^{]*\{dimension_numbers = #tpu\.dot_dimension_numbers<\[([\d, ]*)\][^:]*"
                       r": (vector<[^>]*>), (vector<[^>]*>), vector<[^>]*> -> (vector<[^>]*>)", body):
    key = m.group(0).split("{", 1)[1]
    if key in seen:
      continue
    seen.add(key)
    lhs = [int(d) for d in re.findall(r"(\d+)x", m.group(2))]
    out = [int(d) for d in re.findall(r"(\d+)x", m.group(4))]
    contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d.strip())
    flops += 2.0 * math.prod(out) * contracted
    types |= {re.search(r"x([a-z]+\d*)>", v).group(1) for v in (m.group(2), m.group(3))}
  return flops, types == {"i8"}


def _copies(grid: tuple[int, ...], transform_body: str) -> int:
  """How many times a block is copied: prod(grid[:j + 1]), j the innermost grid axis longer than 1
  that its index map reads (1 when it reads none)."""
  used = [i for i in range(len(grid)) if re.search(rf"%arg{i}\b", transform_body) and grid[i] > 1]
  return math.prod(grid[:max(used) + 1]) if used else 1


def kernel_cost(text: str) -> KernelCost:
  """The modelled work of the kernel in Mosaic MLIR `text` (ValueError without a gridded func)."""
  functions = _functions(text)
  main = next((n for n, (sig, _) in functions.items() if "iteration_bounds" in sig), None)
  if main is None:
    raise ValueError("no func.func with iteration_bounds in the kernel module")
  signature, body = functions[main]
  grid = _int_array(signature, "iteration_bounds")
  prefetch = re.search(r"scalar_prefetch = (\d+)", signature)
  prefetch = int(prefetch.group(1)) if prefetch else 0
  windows = re.findall(r"transform_indices = @(\w+), window_bounds = array<i64(?:: ([\d, ]+))?>", signature)
  arguments = re.findall(r"%arg\d+: ([^,)]*(?:<[^>]*>[^,)]*)?)", signature.split(") ")[0] + ")")
  memrefs = arguments[len(grid) + prefetch:len(grid) + prefetch + len(windows)]
  total_bytes = 0.0
  for (transform, bounds), memref in zip(windows, memrefs):
    m = _MEMREF.search(memref)
    element = _ELEMENT_BYTES.get(m.group(2), 4) if m else 4
    block = math.prod(int(v) for v in bounds.split(",")) if bounds else 1
    total_bytes += block * element * _copies(grid, functions.get(transform, ("", ""))[1])
  step_flops, int8 = _matmul_step_flops(body)
  return KernelCost(name=main, grid=grid, flops=step_flops * math.prod(grid), bytes=total_bytes, int8=int8)
