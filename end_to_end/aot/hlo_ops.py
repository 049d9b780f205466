"""A compiled TPU program's scheduled instructions, read from its HLO text (`compiled.as_text()`).

What the breakdown (`aot.breakdown`) needs of each scheduled instruction: its opcode, result type,
operands, the computations it calls, libtpu's `estimated_cycles` (the cost model's figure that
libtpu writes into the instruction's backend config), the JAX op name in its metadata, and, for a
fusion, the ops inside it; plus the matmul FLOPs (convolution and dot, the way XLA:TPU writes a
`dot_general`) and the HBM bytes an instruction reads and writes. No JAX import: plain text.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of each HLO element type (4-bit types count half a byte).
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
               "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
               "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z0-9\-_]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: `name = shape opcode(operands), attributes`."""
  name: str
  shape: str
  opcode: str
  arguments: str
  attributes: str

  @property
  def operands(self) -> tuple[str, ...]:
    return tuple(re.findall(r"%([\w.\-]+)", self.arguments))

  def attribute(self, key: str) -> str | None:
    """The value of `key=%name` or `key="text"` among the attributes (None if absent)."""
    m = re.search(rf'\b{key}=(?:%([\w.\-]+)|"([^"]*)")', self.attributes)
    return None if m is None else m.group(1) or m.group(2)

  @property
  def estimated_cycles(self) -> int | None:
    m = re.search(r'"estimated_cycles":"(\d+)"', self.attributes)
    return None if m is None else int(m.group(1))

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attributes)
    return "" if m is None else m.group(1)

  @property
  def branches(self) -> list[str]:
    """The branch computations of a conditional."""
    m = re.search(r"branch_computations=\{([^}]*)\}", self.attributes)
    if m:
      return re.findall(r"%([\w.\-]+)", m.group(1))
    return [c for c in (self.attribute("true_computation"), self.attribute("false_computation")) if c]


@dataclasses.dataclass(frozen=True)
class Module:
  """The computations of an HLO module (name -> instructions, in order) and the entry's name."""
  computations: dict[str, list[Instruction]]
  entry: str

  def symbols(self, computation: str) -> dict[str, Instruction]:
    return {i.name: i for i in self.computations[computation]}

  def fused_ops(self, computation: str) -> set[str]:
    """Every opcode inside a fused computation, nested fusions included."""
    ops = set()
    for i in self.computations.get(computation, []):
      ops.add(i.opcode)
      if i.attribute("calls"):
        ops |= self.fused_ops(i.attribute("calls"))
    return ops


def parse_module(text: str) -> Module:
  """The computations of `compiled.as_text()` (ValueError when it has no ENTRY computation)."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTRUCTION.match(line) if current else None
    if m:
      name, shape, opcode, rest = m.groups()
      depth, end = 1, len(rest)
      for k, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
          end = k
          break
      computations[current].append(Instruction(name, shape, opcode, rest[:end], rest[end + 1:]))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
  return Module(computations, entry)


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...], str]]:
  """(element type, dims, layout) of every array in a result type (a tuple gives several)."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d), layout or "")
          for dtype, dims, layout in _ARRAY.findall(shape) if dtype in DTYPE_BYTES]


def hbm_bytes(shape: str) -> float:
  """Bytes of the arrays of `shape` that live in HBM: an array in another memory space (`S(1)`:
  VMEM, `S(2)`, ...) costs no HBM traffic."""
  return sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims, layout in array_shapes(shape)
             if not re.search(r"S\([1-9]\d*\)", layout))


def _window_field(window: str, key: str, count: int, default: int) -> list[int]:
  """One `window={...}` field per spatial dim: size=3x1, stride=.., lhs_dilate=.., rhs_dilate=.."""
  m = re.search(rf"\b{key}=([\dx]+)", window)
  return [int(v) for v in m.group(1).split("x")] if m else [default] * count


def _valid_taps(in_size: int, out_size: int, window: str, dim: int, count: int) -> int:
  """Over every output position of one spatial dim: how many of its window's taps land on a real
  input element (not padding, not a hole of an lhs dilation)."""
  size = _window_field(window, "size", count, 1)[dim]
  stride = _window_field(window, "stride", count, 1)[dim]
  dilate = _window_field(window, "rhs_dilate", count, 1)[dim]
  holes = _window_field(window, "lhs_dilate", count, 1)[dim]
  m = re.search(r"\bpad=([\d_x\-]+)", window)
  low = int(m.group(1).split("x")[dim].split("_")[0]) if m else 0
  if holes == 1:  # per tap: the output positions o with 0 <= o * stride + k * dilate - low < in_size
    return sum(max(0, min(out_size - 1, (in_size + low - k * dilate - 1) // stride)
                   - max(0, -(-(low - k * dilate) // stride)) + 1) for k in range(size))
  extent = (in_size - 1) * holes + 1
  return sum(1 for o in range(out_size) for k in range(size)
             if 0 <= (p := o * stride + k * dilate - low) < extent and p % holes == 0)


def _convolution_flops(op: Instruction, symbols: dict[str, Instruction], out: tuple[int, ...]) -> float:
  """2 x (output batch x features) x input features x the window taps that meet real input.

  XLA:TPU writes a `dot_general` with two free dims on one side as a convolution whose window
  spans one of them, padded by its size - 1 on both sides (`window={size=1x40 pad=0_0x39_39}`):
  each output position meets ONE real input element, so counting whole windows overstated those
  matmuls' FLOPs by the window size (40x for the heads axis)."""
  operands = [array_shapes(symbols[o].shape)[0][1] if o in symbols else () for o in op.operands[:2]]
  labels = re.search(r"dim_labels=([^_]*)_([^-]*)->(\S+?)(?:,|$)", op.attributes)
  if not all(operands) or not labels:
    return 0.0
  (lhs, rhs), (lhs_l, rhs_l, out_l) = operands, labels.groups()
  if "i" not in rhs_l or "o" not in rhs_l:
    return 0.0
  m = re.search(r"window=\{([^}]*)\}", op.attributes)
  window = m.group(1) if m else ""
  spatial = sorted(c for c in out_l if c.isdigit())
  taps = math.prod(_valid_taps(lhs[lhs_l.index(c)], out[out_l.index(c)], window, d, len(spatial))
                   for d, c in enumerate(spatial))
  return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def instruction_flops(op: Instruction, symbols: dict[str, Instruction]) -> float:
  """2 x output elements x contracted length of one convolution or dot (0 for anything else)."""
  out = array_shapes(op.shape)
  if not out or op.opcode not in ("convolution", "dot") or len(op.operands) < 2:
    return 0.0
  if op.opcode == "convolution":
    return _convolution_flops(op, symbols, out[0][1])
  elements = math.prod(out[0][1])
  lhs = array_shapes(symbols[op.operands[0]].shape)[0][1] if op.operands[0] in symbols else ()
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attributes)
  contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
  return 2.0 * elements * contracted


def matmul_flops(module: Module, computation: str) -> tuple[float, bool]:
  """(FLOPs, all int8) of the convolutions and dots in a (fused) computation, nested fusions
  included; "all int8": every one multiplies s8 by s8 (the chip's int8 rate applies)."""
  symbols, flops, int8 = module.symbols(computation), 0.0, True
  for op in module.computations.get(computation, []):
    if op.attribute("calls") and op.opcode == "fusion":
      inner, inner_int8 = matmul_flops(module, op.attribute("calls"))
      flops, int8 = flops + inner, int8 and (inner_int8 or inner == 0)
    f = instruction_flops(op, symbols)
    if f:
      flops += f
      types = {array_shapes(symbols[o].shape)[0][0] for o in op.operands[:2] if o in symbols}
      int8 = int8 and types == {"s8"}
  return flops, int8 and flops > 0


def _sliced_bytes(module: Module, computation: str, index: int) -> float | None:
  """Bytes a fused computation reads of its parameter `index` when it only slices it (through
  nested fusions too), or None when it reads it whole."""
  instructions = module.computations.get(computation, [])
  name = next((i.name for i in instructions if i.opcode == "parameter" and i.arguments.strip() == str(index)), None)
  total = 0.0
  for user in (i for i in instructions if name in i.operands):
    if user.opcode in ("dynamic-slice", "slice") and user.operands[0] == name:
      total += hbm_bytes(user.shape)
    elif user.opcode == "fusion":
      inner = [_sliced_bytes(module, user.attribute("calls"), k) for k, o in enumerate(user.operands) if o == name]
      if any(b is None for b in inner):
        return None
      total += sum(inner)
    else:
      return None
  return total if name is not None else None


def operand_bytes(module: Module, op: Instruction, symbols: dict[str, Instruction]) -> float:
  """HBM bytes an instruction reads: each operand's, except that a fusion operand the fusion only
  slices (a block's weights out of the stacked [layers, ...] array) counts as the slices' bytes."""
  total = 0.0
  for k, name in enumerate(op.operands):
    if name not in symbols:
      continue
    sliced = _sliced_bytes(module, op.attribute("calls"), k) if op.opcode == "fusion" else None
    total += hbm_bytes(symbols[name].shape) if sliced is None else min(sliced, hbm_bytes(symbols[name].shape))
  return total
