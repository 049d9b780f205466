"""Where a compiled TPU step's modelled time goes: libtpu's estimated cycles by op class, each
class against the roofline it could reach on the chip, and a modelled MFU.

  python -m end_to_end.bench.pipeline --aot v6e:2x4 --aot-models 14b --stages step --breakdown

Three models, each said where it is used:

- XLA's ops: libtpu's own cost model, the `estimated_cycles` it writes into every scheduled
  instruction (`hlo_ops.Instruction.estimated_cycles`).
- Pallas kernels (libtpu models none): their grid and blocks (`kernel_model.kernel_cost`), the
  larger of the MXU FLOPs at the chip's peak and the block copies at its HBM bandwidth.
- Collectives (libtpu writes no cycles for them either): the bytes a device sends at half the chip's
  bidirectional ICI bandwidth (one direction; all links busy, one hop, no overlap with compute):
  an all-to-all or all-gather over D devices (D - 1) / D of its result, an all-reduce twice that,
  a permute all of it.

Each scheduled op gets a class (`CLASSES`, `classify`), its FLOPs (convolutions and dots, the way
XLA:TPU writes a dot_general) and the HBM bytes it reads and writes (arrays in VMEM, `S(1)`, cost
none), and its roofline: max(FLOPs at MXU peak, bytes at HBM bandwidth). The step's block loop
(the entry's `while` with the largest trip count: the transformer's `lax.scan`) is reported per
block; the step is the block x its trip count + everything outside it. Modelled MFU = the MXU
FLOPs executed (XLA's matmuls + the kernels', padding included) at the bf16 peak / the modelled
time (XLA's estimated cycles + the kernels' + the collectives' modelled cycles). Cycles convert to
seconds at `Chip.clock_hz`. A compile-time model, not a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

from end_to_end.aot import hlo_ops
from pipelines.storage import video_io


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU chip's published peaks (Google Cloud TPU docs: cloud.google.com/tpu/docs/v5e and
  /v6e, "Peak compute per chip", "HBM bandwidth per chip", "Bidirectional inter-chip
  interconnect bandwidth (per chip)") and its clock. The docs publish no clock: it is the bf16
  peak over the MXUs' FLOPs per cycle (v5e: 4 MXUs of 128 x 128, 2 FLOPs a multiply-add: 1.50 GHz;
  v6e: 4 of 256 x 256: 1.75 GHz, the 4.7x over v5e being 4x the MXU area x 1.17x the clock).
  Cross-check against libtpu's own model: at these clocks its estimate of a large elementwise
  program streams HBM at 81% of the published bandwidth on both chips, and of one 8192^3 bf16
  matmul runs at 70% (v6e) / 88% (v5e) of the MXU peak, never above it."""
  name: str
  bf16_flops: float
  int8_ops: float
  hbm_bytes: float
  ici_bytes: float
  clock_hz: float

  def flops_per_cycle(self, int8: bool = False) -> float:
    return (self.int8_ops if int8 else self.bf16_flops) / self.clock_hz

  @property
  def hbm_per_cycle(self) -> float:
    return self.hbm_bytes / self.clock_hz

  @property
  def ici_per_cycle(self) -> float:
    """Bytes a chip sends per cycle: half its bidirectional ICI bandwidth."""
    return self.ici_bytes / 2 / self.clock_hz


# device_kind -> chip (the topology's devices name their kind).
CHIPS = {"TPU v5 lite": Chip("v5e", 197e12, 394e12, 819e9, 400e9, 1.5e9),
         "TPU v6 lite": Chip("v6e", 918e12, 1836e12, 1638e9, 800e9, 1.75e9)}
CLASSES = ("matmul", "Pallas kernels", "collectives", "collective layout", "attention glue", "norm/RoPE",
           "elementwise", "layout", "other")
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")
# Ops that move or mask data without arithmetic: a fusion of only these is a relayout.
MOVEMENT = {"copy", "transpose", "slice", "pad", "concatenate", "reshape", "bitcast", "dynamic-slice",
            "dynamic-update-slice", "broadcast", "iota", "constant", "parameter", "tuple", "get-tuple-element",
            "compare", "select", "convert", "and", "or", "not", "maximum", "minimum", "reverse", "copy-start",
            "copy-done", "slice-start", "slice-done"}
TRANSPARENT = {"bitcast", "get-tuple-element", "tuple"}  # no work: adjacency looks through them


@dataclasses.dataclass(frozen=True)
class Op:
  """One scheduled op's figures, in cycles of the chip's clock.

  Attributes:
    estimated: libtpu's estimated cycles (0 where it writes none).
    modelled: what the modelled time counts: `estimated`, or for a kernel / collective its model.
    roofline: max(FLOPs at MXU peak, HBM bytes at bandwidth); ICI bytes for a collective.
  """
  name: str
  cls: str
  estimated: float
  modelled: float
  roofline: float
  flops: float
  bytes: float
  note: str = ""


def _collective_kind(opcode: str) -> str | None:
  base = opcode.removesuffix("-start").removesuffix("-done")
  return base if base in COLLECTIVES else None


def _is_layout(module: hlo_ops.Module, op: hlo_ops.Instruction) -> bool:
  if op.opcode == "fusion":
    return module.fused_ops(op.attribute("calls") or "") <= MOVEMENT
  return op.opcode in MOVEMENT


def _neighbours(instructions: list[hlo_ops.Instruction]) -> tuple[dict, dict]:
  """(operands, users) of every instruction, looking through `TRANSPARENT` ones."""
  by_name = {i.name: i for i in instructions}

  def resolve(name, seen=()):
    i = by_name.get(name)
    if i is None or i.opcode not in TRANSPARENT or name in seen:
      return [name] if i is not None else []
    return [r for o in i.operands for r in resolve(o, seen + (name,))]

  operands = {i.name: [r for o in i.operands for r in resolve(o)] for i in instructions}
  users = collections.defaultdict(list)
  for name, found in operands.items():
    for o in found:
      users[o].append(name)
  return operands, users


def _collective_layouts(module: hlo_ops.Module, instructions: list[hlo_ops.Instruction],
                        is_norm: Callable[[hlo_ops.Instruction], bool]) -> set[str]:
  """Relayouts that feed a collective or consume its result, through chains of relayouts (a
  norm's own relayout stays the norm's)."""
  operands, users = _neighbours(instructions)
  by_name = {i.name: i for i in instructions}
  candidates = {i.name for i in instructions if _is_layout(module, i) and i.opcode not in TRANSPARENT
                and not is_norm(i) and _collective_kind(i.opcode) is None}
  found = set()
  for links in (operands, users):  # downstream of a collective, then upstream of one
    frontier = {i.name for i in instructions if _collective_kind(i.opcode)}
    reached = set(frontier)
    while frontier:
      step = {n for n in candidates - reached if any(o in frontier for o in links[n])}
      reached |= step
      frontier = step
    found |= reached - {n for n in reached if _collective_kind(by_name[n].opcode)}
  return found


def _is_norm(module: hlo_ops.Module, op: hlo_ops.Instruction) -> bool:
  name = op.op_name.lower()
  fused = module.fused_ops(op.attribute("calls") or "") if op.opcode == "fusion" else set()
  return "norm" in name or "rope" in name or "rsqrt" in fused or op.opcode == "rsqrt"


def classify(module: hlo_ops.Module, op: hlo_ops.Instruction, collective_layouts: set[str]) -> str:
  """The op's class in `CLASSES` (rules in that order; see the module docstring)."""
  fused = module.fused_ops(op.attribute("calls") or "") if op.opcode == "fusion" else set()
  if op.opcode == "custom-call" and op.attribute("custom_call_target") == "tpu_custom_call":
    return "Pallas kernels"
  if _collective_kind(op.opcode):
    return "collectives"
  if op.opcode in ("convolution", "dot") or fused & {"convolution", "dot"}:
    return "matmul"
  if _is_norm(module, op):
    return "norm/RoPE"
  if op.name in collective_layouts:
    return "collective layout"
  if any(k in op.op_name for k in ("jit(_usp)", "_local_attention", "attention")):
    return "attention glue"
  if _is_layout(module, op):
    return "layout"
  return "elementwise" if op.opcode == "fusion" or op.estimated_cycles else "other"


def _group_size(op: hlo_ops.Instruction, devices: int) -> int:
  """Devices in one replica group (`{{0,1,..}}`, `[G,D]<=[N]` or `mesh[...] {'axis'}`)."""
  if m := re.search(r"replica_groups=\{\{([\d,]*)\}", op.attributes):
    return len(m.group(1).split(","))
  if m := re.search(r"replica_groups=\[\d+,(\d+)\]", op.attributes):
    return int(m.group(1))
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", op.attributes):
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return max(1, math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", m.group(2))))
  return devices


def _collective_op(op: hlo_ops.Instruction, chip: Chip, devices: int) -> Op:
  kind = _collective_kind(op.opcode)
  arrays = hlo_ops.array_shapes(op.shape)
  sizes = [math.prod(d) * hlo_ops.DTYPE_BYTES[t] for t, d, _ in arrays]
  size = 0.0 if op.opcode.endswith("-done") or not sizes else max(sizes)
  d = _group_size(op, devices)
  factor = {"all-to-all": (d - 1) / d, "all-gather": (d - 1) / d, "all-reduce": 2 * (d - 1) / d,
            "reduce-scatter": d - 1, "collective-permute": 1.0}[kind]
  cycles = factor * size / chip.ici_per_cycle
  return Op(op.name, "collectives", float(op.estimated_cycles or 0), cycles, cycles, 0.0, size,
            f"{kind} over {d}")


def _op_record(module: hlo_ops.Module, op: hlo_ops.Instruction, cls: str, symbols: dict, chip: Chip,
               kernel_cost: Callable[[str], Any], devices: int) -> Op | None:
  """The op's figures (None for an op without work: no estimate, not a kernel or collective)."""
  if cls == "collectives":
    return _collective_op(op, chip, devices)
  if cls == "Pallas kernels":
    body = re.search(r'"body":"([^"]*)"', op.attributes)
    try:
      cost = kernel_cost(body.group(1))
    except Exception as e:  # noqa: BLE001 - an unreadable kernel is a row that says so, not a crash
      return Op(op.name, cls, 0.0, 0.0, 0.0, 0.0, 0.0, f"not modelled: {type(e).__name__}: {e}"[:120])
    cycles, bound = cost.cycles(chip.flops_per_cycle(cost.int8), chip.hbm_per_cycle)
    return Op(op.name, cls, 0.0, cycles, cycles, cost.flops, cost.bytes,
              f"{cost.name} grid {'x'.join(map(str, cost.grid))}, {bound}-bound")
  estimated = op.estimated_cycles
  if not estimated:
    return None
  flops, int8 = (hlo_ops.matmul_flops(module, op.attribute("calls")) if op.opcode == "fusion"
                 else (hlo_ops.instruction_flops(op, symbols), False)) if cls == "matmul" else (0.0, False)
  moved = hlo_ops.operand_bytes(module, op, symbols) + hlo_ops.hbm_bytes(op.shape)
  roofline = max(flops / chip.flops_per_cycle(int8), moved / chip.hbm_per_cycle)
  where = "/".join(op.op_name.split("/")[-2:])  # the JAX function and primitive it came from
  return Op(op.name, cls, float(estimated), float(estimated), roofline, flops, moved, where)


def _trip_count(module: hlo_ops.Module, condition: str) -> int:
  """N of a `while` whose condition is `counter < N` (1 when it is not that)."""
  instructions = module.computations.get(condition, [])
  constants = {i.name: i.arguments for i in instructions if i.opcode == "constant"}
  for i in instructions:
    if i.opcode == "compare" and "direction=LT" in i.attributes:
      values = [constants[o] for o in i.operands if o in constants]
      if values and values[0].lstrip("-").isdigit():
        return int(values[0])
  return 1


def walk(module: hlo_ops.Module, computation: str, chip: Chip, kernel_cost: Callable[[str], Any],
         devices: int, times: int = 1) -> list[tuple[Op, int]]:
  """(op, how many times it runs) of every op with work reachable from `computation`: a `while`
  body x its trip count, a conditional's costliest branch, a call's callee."""
  instructions = module.computations[computation]
  symbols = {i.name: i for i in instructions}
  layouts = _collective_layouts(module, instructions, lambda i: _is_norm(module, i))
  out: list[tuple[Op, int]] = []
  for op in instructions:
    if op.opcode == "while":
      n = _trip_count(module, op.attribute("condition"))
      out += walk(module, op.attribute("body"), chip, kernel_cost, devices, times * n)
      continue
    if op.opcode == "conditional":
      branches = [walk(module, b, chip, kernel_cost, devices, times) for b in op.branches]
      out += max(branches, key=lambda ops: sum(o.modelled * t for o, t in ops), default=[])
      continue
    if op.opcode == "call" and op.attribute("to_apply"):
      out += walk(module, op.attribute("to_apply"), chip, kernel_cost, devices, times)
      continue
    record = _op_record(module, op, classify(module, op, layouts), symbols, chip, kernel_cost, devices)
    if record is not None:
      out.append((record, times))
  return out


def block_loop(module: hlo_ops.Module) -> tuple[str, int] | None:
  """(body, trip count) of the entry's `while` with the largest trip count (the block scan)."""
  loops = [(op.attribute("body"), _trip_count(module, op.attribute("condition")))
           for op in module.computations[module.entry] if op.opcode == "while"]
  return max(loops, key=lambda loop: loop[1], default=None)


def summarise(ops: list[tuple[Op, int]], chip: Chip) -> dict[str, Any]:
  """Per class and in total: estimated / modelled / roofline cycles, FLOPs and HBM bytes (each op
  x the times it runs), and the modelled MFU (MXU FLOPs at the bf16 peak / modelled cycles)."""
  classes = {c: dict(estimated=0.0, modelled=0.0, roofline=0.0, flops=0.0, bytes=0.0, ops=0) for c in CLASSES}
  for op, times in ops:
    row = classes[op.cls]
    for key in ("estimated", "modelled", "roofline", "flops", "bytes"):
      row[key] += getattr(op, key) * times
    row["ops"] += 1
  total = {k: sum(r[k] for r in classes.values()) for k in ("estimated", "modelled", "roofline", "flops", "bytes")}
  mxu = classes["matmul"]["flops"] + classes["Pallas kernels"]["flops"]
  ideal = mxu / chip.flops_per_cycle()
  return dict(classes=classes, total=total, mxu_flops=mxu, ideal_cycles=ideal,
              mfu=ideal / total["modelled"] if total["modelled"] else 0.0)


def analyse(hlo_text: str, device_kind: str, devices: int,
            kernel_cost: Callable[[str], Any] | None = None, *, program: str = "step",
            loop: bool = True) -> dict[str, Any]:
  """The breakdown of a compiled program for `device_kind` (a `CHIPS` key) on `devices` chips:
  per block of its block loop and per step (see the module docstring).

  Args:
    kernel_cost: body (base64) -> `kernel_model.KernelCost`; default: decode the Mosaic module.
    program: what the program is, for the report ("step"; e.g. "decode later-chunk program").
    loop: report the largest `while` as the block loop (the step's layer scan); False: the whole
      program only (e.g. the VAE decoder's, which has no block loop), loops still counted by trips.

  Raises:
    ValueError: a device kind without a `CHIPS` entry, or text without an ENTRY computation.
  """
  from end_to_end.aot import kernel_model

  if device_kind not in CHIPS:
    raise ValueError(f"no roofline for device kind {device_kind!r}; known: {', '.join(CHIPS)}")
  chip = CHIPS[device_kind]
  if kernel_cost is None:
    kernel_cost = functools.lru_cache(maxsize=None)(
        lambda body: kernel_model.kernel_cost(kernel_model.mosaic_text(body)))
  module = hlo_ops.parse_module(hlo_text)
  loop = block_loop(module) if loop else None
  step = walk(module, module.entry, chip, kernel_cost, devices)
  block = walk(module, loop[0], chip, kernel_cost, devices) if loop else []
  largest = sorted(block or step, key=lambda pair: -pair[0].modelled * pair[1])[:12]
  return dict(chip=dataclasses.asdict(chip), devices=devices, program=program, blocks=loop[1] if loop else 0,
              block=summarise(block, chip), step=summarise(step, chip),
              largest=[dict(dataclasses.asdict(op), times=t) for op, t in largest])


def _table(summary: dict[str, Any], chip: dict[str, Any], title: str) -> list[str]:
  lines = [f"{title:20s} {'est Mcyc':>9s} {'model Mcyc':>10s} {'share':>6s} {'roofline':>9s} {'roof/model':>10s} "
           f"{'TFLOP':>7s} {'GB HBM':>7s}"]
  total = summary["total"]["modelled"] or 1.0
  for name, r in list(summary["classes"].items()) + [("total", summary["total"])]:
    if name != "total" and not r["modelled"]:
      continue
    lines.append(f"{name:20s} {r['estimated'] / 1e6:9.2f} {r['modelled'] / 1e6:10.2f} {r['modelled'] / total:6.1%} "
                 f"{r['roofline'] / 1e6:9.2f} {r['roofline'] / (r['modelled'] or 1):10.1%} {r['flops'] / 1e12:7.2f} "
                 f"{r['bytes'] / 1e9:7.2f}")
  ms = summary["total"]["modelled"] / chip["clock_hz"] * 1e3
  lines.append(f"  modelled {ms:.1f} ms; MXU work {summary['mxu_flops'] / 1e12:.2f} TFLOP = "
               f"{summary['ideal_cycles'] / 1e6:.2f} Mcycles at the bf16 peak; modelled MFU {summary['mfu']:.1%}")
  return lines


def format_breakdown(result: dict[str, Any]) -> str:
  """The breakdown as text: the block's table (where there is a block loop), the whole program's,
  and the largest ops (the block's, or the program's: each op x the times it runs)."""
  chip = result["chip"]
  lines = [f"modelled time by op class on {chip['name']} ({chip['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, "
           f"{chip['hbm_bytes'] / 1e9:.0f} GB/s HBM, {chip['ici_bytes'] / 1e9:.0f} GB/s ICI, clock "
           f"{chip['clock_hz'] / 1e9:.2f} GHz; Mcycles; XLA ops: libtpu's estimate, Pallas kernels: grid "
           "model, collectives: ICI model; roofline: max(FLOPs at MXU peak, bytes at HBM bandwidth)):"]
  if result["blocks"]:
    lines += _table(result["block"], chip, f"one block (x{result['blocks']})")
  lines += _table(result["step"], chip, f"whole {result.get('program', 'step')}")
  lines.append("largest ops" + (" of one block" if result["blocks"] else "") + " (Mcycles modelled / roofline):")
  lines += [f"  {o['name']:34s} {o['cls']:18s} {o['modelled'] / 1e6:7.2f} / {o['roofline'] / 1e6:6.2f}  {o['note']}"
            + (f"  (x{o['times']} runs)" if o.get("times", 1) > 1 else "") for o in result["largest"]]
  return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
  """Writes `result` to `path` atomically (`video_io.write_json`), replacing what is there."""
  video_io.write_json(result, path, overwrite=True)
