"""The Pallas kernels (attention/kernels.py) in interpret mode, against the float64 and dense references.

(The local grid runs with backend="pallas" in tests/attention/test_blockwise.py, beside the XLA loops;
the kernel's `Start` is checked in test_carry.py, the backend choice and block sizes in test_settings.py.)

`backend="pallas"` on CPU runs the TPU kernel (grid over key blocks, carry in scratch) in Pallas
interpret mode; the GPU kernel (one program per query block looping over key blocks) is forced with
`kernels.attend_kernel(kernel="gpu")`. Tolerances are the XLA path's (tests/numerics.py): the kernels
do the same arithmetic in the same order per block, so they are no less exact.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import BlockSizes, attention_reference, local_attention, make_mesh, usp_attention
from attention import block_layout, blockwise, fixed_m, kernels
from attention.carry import Start, finish, init_carry
from attention.halo import halo_attention
from tests.numerics import fp32_attention_tol as fp32_tol
from tests.numerics import within
from tests.attention.test_blockwise import BF16_TOL, _inputs
from tests.attention.test_usp import MESHES

pytestmark = pytest.mark.numerics

SIZES = BlockSizes(block_q=128, block_kv=128)
IMPLS = ("lse", "fixed_m", "auto")


@pytest.mark.parametrize("H,mode", [(H, mode) for H in (64, 80, 128) for mode in ("lse", "fixed_m")]
                         + [(128, "auto:fixed_m"), (128, "auto:lse")])
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_equals_xla_block_update(H, kernel, mode):
  """Both kernels against `blockwise.attend`'s XLA loops on one carry: GQA (G = 2), ragged valid
  lengths, block padding of T and S, a causal window, a carry that already holds a previous key set
  (a second ring step), head dims 64 / 80 / 128 (80: the GPU kernel's padded, masked loads).
  "auto:X": the auto mode (a cond between the two kernels) with the flag set to pick X, against the XLA X."""
  flag = None
  if mode.startswith("auto:"):
    mode, flag = mode[5:], jnp.asarray(mode == "auto:fixed_m")
  B, K, G, T, S = 2, 2, 2, 200, 300
  rng = np.random.default_rng(H)
  q = jnp.asarray(rng.normal(size=(B, K, G, T, H)) * 0.2, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
  layout = block_layout.BlockLayout.make(T, S, SIZES, "pallas")
  assert (layout.block_q, layout.block_kv, layout.T_pad, layout.S_pad) == (128, 128, 256, 384)
  qp, kp, vp = layout.pad_q(q), layout.pad_kv(k), layout.pad_kv(v)
  kw = dict(mode=mode, q_pos=layout.q_positions(jnp.arange(T)), kv_pos=layout.kv_positions(jnp.arange(S)),
            kv_limit=jnp.asarray([250, 300], jnp.int32), window=40, causal=True, logit_scale=1.0)
  xla = dataclasses.replace(layout, backend="xla")
  m0 = jnp.full(qp.shape[:4], 3.0) if mode == "fixed_m" else None
  first = blockwise.attend(init_carry(qp, m0), qp, kp, vp, layout=xla, **kw)  # a previous step
  want = blockwise.attend(first, qp, kp, vp, layout=xla, **kw)
  got = kernels.attend_kernel(first, qp, kp, vp, kw["q_pos"], kw["kv_pos"], kw["kv_limit"],
                              mode=mode if flag is None else "auto", bq=128, bk=128, S=S, kv_padded=True,
                              window=40, causal=True, logit_scale=1.0, kernel=kernel, fixed=flag)
  # Same per-block arithmetic; only the order of the row sums may differ: <= a few fp32 ulps of
  # the sums' scale (l ~ S keys x 2^(s - m) <= ~1e3; o ~ l x max|v|).
  for name, a, b in zip("olm", (got.o, got.l, got.m), (want.o, want.l, want.m)):
    assert a.shape == b.shape and a.dtype == jnp.float32
    scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), b, 0.0)))) or 1.0
    err = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), a - b, 0.0))))
    within(err, 64 * 2.0**-24 * scale, f"{kernel} {mode} {name}")
    assert bool(jnp.all(jnp.isfinite(a) == jnp.isfinite(b)))
  if H == 80:  # a Carry finished in the kernel (the last ring step), masked head dims on GPU
    out = kernels.attend_kernel(first, qp, kp, vp, kw["q_pos"], kw["kv_pos"], kw["kv_limit"],
                                mode=mode if flag is None else "auto", bq=128, bk=128, S=S, kv_padded=True,
                                window=40, causal=True, logit_scale=1.0, kernel=kernel, fixed=flag,
                                finish_to=jnp.float32)
    ref = finish(want)
    within(float(jnp.max(jnp.abs(out - ref))), 64 * 2.0**-24 * float(jnp.max(jnp.abs(ref))), f"{kernel} {mode} finish")


def _start_case(mode, flag, seed):
  """Inputs of a first key set: GQA, ragged lengths, block padding, a causal window (so the offsets'
  windowed bound, lam = 1), and the Start of `mode` with offsets from the real key statistics."""
  B, K, G, T, S, H = 2, 2, 2, 200, 300, 80
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, K, G, T, H)) * 0.2, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
  layout = block_layout.BlockLayout.make(T, S, SIZES, "pallas")
  limit = jnp.asarray([250, 300], jnp.int32)
  stats = fixed_m.local_key_stats(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), limit)
  c_max = fixed_m.headroom_cap(stats.v_absmax, stats.valid_count)
  offsets = fixed_m.OffsetInputs(stats.k_mean, stats.k_centred_max, c_max, windowed=True)
  start = Start(None if mode == "lse" else offsets)
  kw = dict(q_pos=layout.q_positions(jnp.arange(T)), kv_pos=layout.kv_positions(jnp.arange(S)), kv_limit=limit,
            window=40, causal=True, logit_scale=1.3, fixed=flag)
  return start, layout, layout.pad_q(q), layout.pad_kv(k), layout.pad_kv(v), kw


@pytest.mark.parametrize("mode", ["lse", "fixed_m", "auto:fixed_m", "auto:lse"])
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_start_and_finish_equal_xla(kernel, mode):
  """A `Start` (the empty carry the TPU kernel builds in VMEM, fixed-m offsets included) and
  `finish_to` (o / l written by the kernel in the output dtype) against the XLA loops on the
  materialised carry. The carry's m is compared too: the kernel's own offsets are the ones used."""
  flag = None
  if mode.startswith("auto:"):
    mode, flag = "auto", jnp.asarray(mode == "auto:fixed_m")
  start, layout, qp, kp, vp, kw = _start_case(mode, flag, seed=7)
  xla = dataclasses.replace(layout, backend="xla")
  want = blockwise.attend(start.materialise(qp, kw["logit_scale"], flag), qp, kp, vp, mode=mode, layout=xla, **kw)
  call = functools.partial(kernels.attend_kernel, start, qp, kp, vp, kw["q_pos"], kw["kv_pos"], kw["kv_limit"],
                           mode=mode, bq=128, bk=128, S=layout.S, kv_padded=True, window=40, causal=True,
                           logit_scale=kw["logit_scale"], kernel=kernel, fixed=flag)
  got = call()
  if mode != "lse":  # the offsets formed in the kernel pin m (a positive control on the Start's use)
    pinned = mode == "fixed_m" or bool(flag)
    assert bool(jnp.all(jnp.isfinite(got.m))) == pinned
  for name, a, b in zip("olm", (got.o, got.l, got.m), (want.o, want.l, want.m)):
    scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), b, 0.0)))) or 1.0
    within(float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), a - b, 0.0)))), 64 * 2.0**-24 * scale,
           f"{kernel} {mode} start {name}")
    assert bool(jnp.all(jnp.isfinite(a) == jnp.isfinite(b)))
  out = call(finish_to=jnp.bfloat16)
  assert out.shape == qp.shape and out.dtype == jnp.bfloat16
  ref = finish(want)  # |o / l| <= max|v|: one bf16 rounding (2^-9 relative) plus the carry's ulps
  within(float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))), 2.0**-8 * float(jnp.max(jnp.abs(ref))),
         f"{kernel} {mode} finish")
  assert float(jnp.max(jnp.abs(out.astype(jnp.float32)))) > 0.1  # not vacuous


@functools.partial(jax.jit, static_argnames="mesh")
def _usp_paths(q, k, v, vl, mesh):
  return {impl: usp_attention(q, k, v, mesh=mesh, kv_valid_len=vl, implementation=impl, backend="pallas",
                              block_sizes=SIZES) for impl in IMPLS}


@pytest.mark.parametrize("R,U", MESHES)
def test_usp_kernel_every_mesh(R, U):
  """T = 50 does not divide 8 devices; N=8, K=2 (repeated when U = 4, 8); key padding."""
  mesh = make_mesh(ulysses=U, ring=R)
  q, k, v = _inputs(2, 50, 50, 8, 2, 32, seed=1)
  vl = jnp.asarray([50, 37], jnp.int32)
  ref = attention_reference(q, k, v, kv_valid_len=vl)
  for impl, out in _usp_paths(q, k, v, vl, mesh).items():
    assert out.shape == q.shape and out.dtype == q.dtype
    within(float(jnp.max(jnp.abs(out - ref))), fp32_tol(v), f"pallas usp {impl} R={R} U={U}")


@pytest.mark.parametrize("R,U", [(2, 2), (1, 4)])
def test_usp_kernel_bf16(R, U):
  mesh = make_mesh(ulysses=U, ring=R)
  q, k, v = _inputs(1, 50, 50, 8, 2, 32, dtype=jnp.bfloat16)
  ref = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)))
  for impl, out in _usp_paths(q, k, v, None, mesh).items():
    assert out.dtype == jnp.bfloat16
    within(float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))), BF16_TOL, f"pallas usp {impl}")


def test_usp_kernel_sink_on_one_shard_takes_lse():
  """A sink on one shard fails the mesh-uniform gate: `auto` must run the LSE kernel on every device
  (bitwise the LSE run) while forced `fixed_m` reports NaN; positive control: on clean input `auto`
  is bitwise the fixed-m run."""
  mesh = make_mesh(ulysses=2, ring=2)
  q, k, v = _inputs(1, 64, 64, 4, 4, 32, seed=3)
  clean = _usp_paths(q, k, v, None, mesh)
  assert float(jnp.max(jnp.abs(clean["auto"] - clean["fixed_m"]))) == 0.0
  assert float(jnp.max(jnp.abs(clean["auto"] - clean["lse"]))) > 0.0
  q = q.at[:, 48:, 2].multiply(8.0)  # tokens 48..63: the last device only; u ~ 500 bits > the gate's ~240
  k = k.at[:, 48:, 2].multiply(8.0)
  outs = _usp_paths(q, k, v, None, mesh)
  assert float(jnp.max(jnp.abs(outs["auto"] - outs["lse"]))) == 0.0
  assert bool(jnp.all(jnp.isnan(outs["fixed_m"])))
  ref = attention_reference(q, k, v)
  others = jnp.asarray([0, 1, 3])
  within(float(jnp.max(jnp.abs(outs["auto"][:, :, others] - ref[:, :, others]))), fp32_tol(v), "other heads")


def test_halo_kernel_matches_windowed_reference():
  mesh = make_mesh(ulysses=2, ring=2)
  q, k, v = _inputs(1, 90, 90, 4, 2, 32, seed=4)
  ref = attention_reference(q, k, v, window=20, causal=True)
  out = halo_attention(q, k, v, mesh=mesh, window=20, causal=True, backend="pallas", block_sizes=SIZES)
  within(float(jnp.max(jnp.abs(out - ref))), fp32_tol(v), "halo pallas")


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_path_is_differentiable(impl):
  """jax.grad through the Pallas kernels (custom VJP: the XLA loops' transpose) equals the dense
  reference's gradient within 1e-5 of its scale (fp32; the forward error is ~1e-6 relative). 150
  tokens in 128-row blocks: the kernel reads them unpadded, the VJP's XLA loops pad them."""
  q, k, v = _inputs(1, 150, 150, 4, 2, 32, seed=5)
  vl = jnp.asarray([120], jnp.int32)

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

  ours = jax.grad(loss(lambda q, k, v: local_attention(q, k, v, kv_valid_len=vl, implementation=impl,
                                                        backend="pallas", block_sizes=SIZES)), argnums=(0, 1, 2))
  ref = jax.grad(loss(lambda q, k, v: attention_reference(q, k, v, kv_valid_len=vl)), argnums=(0, 1, 2))
  for name, a, b in zip("qkv", ours(q, k, v), ref(q, k, v)):
    within(float(jnp.max(jnp.abs(a - b))), 1e-5 * float(jnp.max(jnp.abs(b))), f"d{name} {impl}")
  assert float(jnp.max(jnp.abs(ours(q, k, v)[1][:, 120:]))) == 0.0  # padded keys get no gradient



@pytest.mark.parametrize("mode", ["fixed_m", "lse"])
@pytest.mark.parametrize("S,bk,bkc,extra", [(300, 128, None, 0), (420, 256, 128, 0), (400, 256, 128, 256),
                                             (300, 512, 128, 0), (383, 256, 128, 0), (384, 256, 128, 0)])
def test_tpu_kernel_masks_only_the_padded_key_block(mode, S, bk, bkc, extra):
  """Block padding alone (no limit, window or causal mask): the TPU kernel masks only the key blocks
  past slot S. Against the XLA loops with garbage (30x the keys' scale) in the padded slots, over
  three key blocks (two unmasked, one masked), or key blocks in 128-key chunks: the last block's
  chunks before slot S unmasked, the one holding it masked, and so the all-padding chunks after it
  (S = 300 in a 512-key block), at S one short of a chunk's end (383) and at a chunk's end (384);
  or one more block of garbage alone (`extra` slots: every chunk of both padded blocks masked). The
  same garbage seen by a kernel told there is no padding changes the output (positive control:
  the mask is what hides it)."""
  B, K, G, T, H = 1, 2, 1, 200, 128
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(B, K, G, T, H)) * 0.2, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
  layout = block_layout.BlockLayout(T, S, 128, bk, "pallas", bkc)
  qp = layout.pad_q(q)
  garbage = jnp.asarray(rng.normal(size=(B, K, layout.S_pad + extra - S, H)) * 30, jnp.float32)
  kp, vp = (jnp.concatenate([x, garbage], axis=2) for x in (k, v))
  kw = dict(q_pos=layout.q_positions(jnp.arange(T)), kv_pos=layout.kv_positions(jnp.arange(S)))
  m0 = jnp.full(qp.shape[:4], 3.0) if mode == "fixed_m" else None
  want = blockwise.attend(init_carry(qp, m0), layout.pad_q(q), layout.pad_kv(k), layout.pad_kv(v), mode=mode,
                          layout=dataclasses.replace(layout, backend="xla"), kv_limit=None, window=None,
                          causal=False, logit_scale=1.0, **kw)
  kv_pos = jnp.pad(kw["kv_pos"], (0, extra), constant_values=block_layout.PAD_POSITION)
  call = functools.partial(kernels.attend_kernel, init_carry(qp, m0), qp, kp, vp, kw["q_pos"], kv_pos, None,
                           mode=mode, bq=128, bk=layout.block_kv, bkc=layout.block_kv_compute, window=None,
                           causal=False, logit_scale=1.0, kernel="tpu")
  got = call(S=S, kv_padded=True)
  for name, a, b in zip("olm", (got.o, got.l, got.m), (want.o, want.l, want.m)):
    scale = float(jnp.max(jnp.abs(b))) or 1.0
    within(float(jnp.max(jnp.abs(a - b))), 64 * 2.0**-24 * scale, f"{mode} {name}")
  leaked = call(S=layout.S_pad + extra, kv_padded=False)
  assert float(jnp.max(jnp.abs(leaked.o - got.o))) > 1.0


def _unpadded_case(mode, masks, seed, S=300, sizes=SIZES):
  """Unpadded heads-major q [B, K, G, T, H], k/v [B, K, S, H] (GQA, G = 2; T = 200 and S = 300: a
  ragged last block of each in 128-wide blocks), the Start of `mode` from the real key statistics,
  and the masks: block padding alone, or a valid-key limit and a causal window."""
  B, K, G, T, H = 2, 2, 2, 200, 80
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, K, G, T, H)) * 0.2, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
  layout = block_layout.BlockLayout.make(T, S, sizes, "pallas")
  limit = jnp.asarray([S - 50, S], jnp.int32) if masks == "limit_window" else None
  windowed = masks == "limit_window"
  stats = fixed_m.local_key_stats(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), limit)
  offsets = fixed_m.OffsetInputs(stats.k_mean, stats.k_centred_max,
                                 fixed_m.headroom_cap(stats.v_absmax, stats.valid_count), windowed=windowed)
  kw = dict(q_pos=layout.q_positions(jnp.arange(T)), kv_pos=layout.kv_positions(jnp.arange(S)), kv_limit=limit,
            window=40 if windowed else None, causal=windowed, logit_scale=1.3)
  return Start(None if mode == "lse" else offsets), layout, (q, k, v), kw


@pytest.mark.parametrize("masks", ["padding", "limit_window"])
@pytest.mark.parametrize("mode", ["lse", "fixed_m", "auto:fixed_m", "auto:lse"])
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_unpadded_kernel_equals_padded_xla(kernel, mode, masks):
  """One whole attention on unpadded operands (the TPU kernel's ceil-divided grid; the GPU kernel
  on padded copies) against the XLA loops on the padded operands. Interpret mode reads NaN past an
  array's end, so the last key block's slots >= S hold NaN keys and values here: an output without
  NaN shows they were masked and zeroed; the positive control tells the TPU kernel there is no
  padding, and the NaN spoil the output."""
  flag = None
  if mode.startswith("auto:"):
    mode, flag = "auto", jnp.asarray(mode == "auto:fixed_m")
  start, layout, (q, k, v), kw = _unpadded_case(mode, masks, seed=11)
  qp, kp, vp = layout.pad_q(q), layout.pad_kv(k), layout.pad_kv(v)
  xla = dataclasses.replace(layout, backend="xla")
  want = finish(blockwise.attend(start.materialise(qp, kw["logit_scale"], flag), qp, kp, vp, mode=mode, layout=xla,
                                 fixed=flag, **kw))[:, :, :, :layout.T]
  call = functools.partial(kernels.attend_kernel, start, q, k, v, kw["q_pos"], kw["kv_pos"], kw["kv_limit"],
                           mode=mode, bq=128, bk=128, S=layout.S, window=kw["window"], causal=kw["causal"],
                           logit_scale=kw["logit_scale"], finish_to=jnp.float32, fixed=flag, kernel=kernel)
  got = call(kv_padded=True)
  assert got.shape == q.shape and got.dtype == jnp.float32
  # Same per-block arithmetic as on padded operands: a few fp32 ulps of |o / l| <= max|v|.
  within(float(jnp.max(jnp.abs(got - want))), 64 * 2.0**-24 * float(jnp.max(jnp.abs(want))), f"{kernel} {mode}")
  assert float(jnp.max(jnp.abs(got))) > 0.1  # not vacuous
  if kernel == "tpu" and masks == "padding" and flag is None:
    leaked = call(kv_padded=False)
    assert not bool(jnp.all(jnp.abs(leaked - got) < 0.1))  # NaN, or rows zeroed by NaN sums


@pytest.mark.parametrize("masks", ["padding", "limit_window"])
@pytest.mark.parametrize("mode", ["lse", "fixed_m"])
def test_key_chunks_equal_the_xla_loops(mode, masks):
  """The TPU kernel's key blocks in chunks (bk = 256 in 128-key chunks, `BlockSizes.block_kv_compute`)
  against the XLA loops at the same blocks: a whole attention on unpadded operands (NaN past the
  keys' end, so an unmasked or unzeroed chunk would spoil the output) from a Start to the finished
  output, and a carry that has seen one key set continued by another and returned (a ring step:
  o, l, m; the padded keys reversed, so the padding and the masked positions move)."""
  start, layout, (q, k, v), kw = _unpadded_case(mode, masks, seed=5, S=500, sizes=BlockSizes(128, 256, 128))
  assert (layout.block_kv, layout.block_kv_compute, layout.S_pad) == (256, 128, 512)
  qp, kp, vp = layout.pad_q(q), layout.pad_kv(k), layout.pad_kv(v)
  xla = dataclasses.replace(layout, backend="xla")
  fresh = start.materialise(qp, kw["logit_scale"])
  want = blockwise.attend(fresh, qp, kp, vp, mode=mode, layout=xla, **kw)
  carry = want  # a carry that has seen one key set (l > 0), continued by a second (a ring step)
  want_2 = blockwise.attend(carry, qp, kp[..., ::-1, :], vp[..., ::-1, :], mode=mode, layout=xla, **kw)
  call = functools.partial(kernels.attend_kernel, q_pos=kw["q_pos"], kv_pos=kw["kv_pos"], limit=kw["kv_limit"],
                           mode=mode, bq=128, bk=256, bkc=128, S=layout.S, kv_padded=True, window=kw["window"],
                           causal=kw["causal"], logit_scale=kw["logit_scale"], kernel="tpu")
  got = call(start, q, k, v, finish_to=jnp.float32)
  ref = finish(want)[:, :, :, :layout.T]
  within(float(jnp.max(jnp.abs(got - ref))), 64 * 2.0**-24 * float(jnp.max(jnp.abs(ref))), f"{mode} {masks} finished")
  assert float(jnp.max(jnp.abs(got))) > 0.1  # not vacuous
  stepped = call(carry, qp, kp[..., ::-1, :], vp[..., ::-1, :])
  for name, a, b in zip("olm", (stepped.o, stepped.l, stepped.m), (want_2.o, want_2.l, want_2.m)):
    scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), b, 0.0)))) or 1.0
    within(float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(b), a - b, 0.0)))), 64 * 2.0**-24 * scale, f"{mode} {name}")
    assert bool(jnp.all(jnp.isfinite(a) == jnp.isfinite(b)))


def test_local_attention_in_key_chunks_equals_the_reference():
  """`BlockSizes.block_kv_compute` reaches the kernel from `local_attention` ("auto": the gate, then
  the fixed-m kernel in 128-key chunks of 256-key blocks), against the dense reference; a chunk
  that does not divide the key block is refused by name."""
  q, k, v = _inputs(1, 300, 500, 4, 2, 64, seed=9)
  ref = attention_reference(q, k, v)
  out = local_attention(q, k, v, backend="pallas", block_sizes=BlockSizes(128, 256, 128))
  within(float(jnp.max(jnp.abs(out - ref))), fp32_tol(v), "pallas chunks")
  qb, kb = jnp.zeros((1, 1, 1, 128, 128)), jnp.zeros((1, 1, 256, 128))
  for bad in (384, 0, -128):  # 0 and -128 would run no chunk at all: a silent zero output
    with pytest.raises(ValueError, match=f"bkc={bad}"):
      kernels.attend_kernel(Start(), qb, kb, kb, jnp.arange(128), jnp.arange(256), None, mode="lse", bq=128, bk=256,
                            bkc=bad, S=256, kv_padded=False, window=None, causal=False, logit_scale=1.0, kernel="tpu")


def test_unpadded_operands_only_for_a_whole_attention():
  """A carry to continue (a ring step) must come padded: unpadded rows are refused by name."""
  start, layout, (q, k, v), kw = _unpadded_case("lse", "padding", seed=1)
  carry = start.materialise(layout.pad_q(q), 1.0, None)
  with pytest.raises(ValueError, match="unpadded operands"):
    kernels.attend_kernel(carry, q, k, v, kw["q_pos"], kw["kv_pos"], None, mode="lse", bq=128, bk=128, S=layout.S,
                          kv_padded=True, window=None, causal=False, logit_scale=1.0, kernel="tpu")
  with pytest.raises(ValueError, match="unpadded operands only from a Start"):
    blockwise.attend(carry, q, k, v, mode="lse", layout=layout, q_pos=kw["q_pos"], kv_pos=kw["kv_pos"])


@pytest.mark.parametrize("masks", ["padding", "limit_window"])
def test_single_key_block_path_equals_the_carry_path(monkeypatch, masks):
  """One key block, LSE from a Start, finished (the text cross-attention): `_tpu_single` writes the
  output without the VMEM carry, bitwise what the carry path gives (alpha = 0 on the first block), on
  unpadded operands with NaN past the keys' end; the spy shows the path was taken, and with it
  turned off the carry path ran instead."""
  start, layout, (q, k, v), kw = _unpadded_case("lse", masks, seed=3)
  one = block_layout.BlockLayout(layout.T, layout.S, 128, 384, "pallas")  # S = 300: one 384-key block
  taken = []
  real = kernels.single_block_path
  monkeypatch.setattr(kernels, "single_block_path", lambda *a: taken.append(real(*a)) or taken[-1])
  call = functools.partial(kernels.attend_kernel, start, q, k, v, one.q_positions(jnp.arange(layout.T)),
                           one.kv_positions(jnp.arange(layout.S)), kw["kv_limit"], mode="lse", bq=128, bk=384,
                           S=layout.S, kv_padded=True, window=kw["window"], causal=kw["causal"],
                           logit_scale=kw["logit_scale"], finish_to=jnp.float32, kernel="tpu")
  got = call()
  assert taken == [True]
  monkeypatch.setattr(kernels, "single_block_path", lambda *a: False)
  carried = call()
  assert not bool(jnp.any(jnp.isnan(got))) and float(jnp.max(jnp.abs(got))) > 0.1
  np.testing.assert_array_equal(np.asarray(got), np.asarray(carried))


def _kernel_names(jaxpr) -> list[str]:
  """The names of the Pallas calls in a jaxpr, its sub-jaxprs' included, in order."""
  names = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      names.append(str(eqn.params["name"]))
    for sub in jax.core.jaxprs_in_params(eqn.params):
      names += _kernel_names(sub)
  return names


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_auto_mode_is_a_cond_between_the_single_mode_kernels(kernel):
  """Mode "auto" runs one of two kernels chosen by a `lax.cond` on the verdict, each of one mode
  (a kernel branching on it per key block ran at LSE's speed on a v5e, fixed-m path included;
  attention/kernels.py): the program holds a cond whose branches are an LSE and a fixed-m kernel, and
  no kernel of mode "auto". The numbers of both branches: `test_kernel_start_and_finish_equal_xla`."""
  start, layout, q, k, v, kw = _start_case("fixed_m", jnp.asarray(True), seed=5)
  fn = lambda flag: kernels.attend_kernel(  # noqa: E731
      start, q, k, v, kw["q_pos"], kw["kv_pos"], kw["kv_limit"], mode="auto", bq=128, bk=128, S=layout.S,
      kv_padded=True, window=kw["window"], causal=kw["causal"], logit_scale=kw["logit_scale"], fixed=flag,
      finish_to=jnp.float32, kernel=kernel)
  jaxpr = jax.make_jaxpr(fn)(jnp.asarray(True)).jaxpr
  conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
  assert len(conds) == 1
  branches = sorted(_kernel_names(b.jaxpr) for b in conds[0].params["branches"])
  assert branches == [["attend_fixed_m"], ["attend_lse"]]
  assert "attend_auto" not in _kernel_names(jaxpr)
