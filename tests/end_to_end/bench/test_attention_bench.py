"""`bench.attention`'s baselines: splash attention at any length (padded to its blocks, the padding
masked), blocks it refuses reported rather than fatal, and the report's rates and ratios. Splash
runs in Pallas' interpret mode here (exact, slow; on a TPU it is compiled)."""

import jax
import numpy as np
import pytest

from end_to_end.bench import attention as bench
from end_to_end.bench import attention_baselines as baselines
from tests.numerics import EPS_F32

T, N, H = 200, 2, 128  # 200: not a multiple of any block, so every Pallas baseline pads


def _qkv(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((1, T, N, H), np.float32) for _ in range(3)]


def _dense(q, k, v):
  return np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla"))


def test_padded_splash_is_dense_attention_and_the_mask_matters():
  """Splash on the padded sequence equals dense attention on the real one: an fp32 softmax average
  of S = 200 values (|v| <= 5) to within S x eps x 5; without the padding's mask the zero keys take
  weight and the output moves (the positive control)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  q, k, v = _qkv()
  out = np.asarray(baselines.splash((1, T, N, H), (128, 128, 128), interpret=True)(q, k, v))
  bound = T * EPS_F32 * 5
  np.testing.assert_allclose(out, _dense(q, k, v), atol=bound, rtol=0)
  padded = baselines.padded_length(T, 128)
  kernel = sk.make_splash_mha(mask=sm.MultiHeadMask([sm.FullMask((padded, padded))] * N), head_shards=1,
                              q_seq_shards=1, block_sizes=sk.BlockSizes(128, 128, 128), interpret=True)
  qh, kh, vh = (baselines._heads_first(x, padded)[0] for x in (q, k, v))
  unmasked = np.asarray(kernel(qh * H ** -0.5, kh, vh))[:, :T].transpose(1, 0, 2)[None]
  assert np.max(np.abs(unmasked - out)) > 100 * bound


def test_splash_folds_the_batch_into_its_heads():
  """At batch 2 (the pipeline's CFG batch) splash runs one kernel over B x N heads: each batch
  element's output is dense attention of its own q, k, v (not of the other element's)."""
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((2, T, N, H), np.float32) for _ in range(3))
  out = np.asarray(baselines.splash((2, T, N, H), (128, 128, 128), interpret=True)(q, k, v))
  want = _dense(q, k, v)
  np.testing.assert_allclose(out, want, atol=T * EPS_F32 * 5, rtol=0)
  assert np.max(np.abs(want[0] - want[1])) > 0.1  # the two elements differ: a mix-up would show


def test_the_report_names_failures_rates_and_the_best_baseline(tmp_path):
  rows = bench.main(["--seq", str(T), "--heads", str(N), "--dtypes", "float32", "--interpret", "--repeats", "1",
                     "--splash-grid", "128x128x128,256x128x64", "--json", str(tmp_path / "r.json")])
  (row,) = rows
  assert set(row["seconds"]) == {"xla_dense", "splash_128x128x128", "lse", "fixed_m"} and row["gate_seconds"] > 0
  assert "multiple of 128" in row["failed"]["splash_256x128x64"]  # splash's own refusal, reported
  assert row["best_baseline"] in ("xla_dense", "splash_128x128x128")
  assert row["tflops"]["fixed_m"] == pytest.approx(row["flops"] / row["seconds"]["fixed_m"] / 1e12)
  assert row["flops"] == 4 * N * T * T * H and row["peak_fraction"] is None  # a CPU: no chip peak
  assert max(row["max_abs_vs"].values()) < T * EPS_F32 * 5


def test_baselines_keeps_the_kinds_asked_for():
  """`--baselines splash` times splash and ours only (no dense attention, which fits at this size
  and is timed by default: the control above); an unknown kind is refused naming it."""
  (row,) = bench.main(["--seq", str(T), "--heads", str(N), "--dtypes", "float32", "--interpret", "--repeats", "1",
                       "--splash-grid", "128x128x128", "--baselines", "splash"])
  assert set(row["seconds"]) == {"splash_128x128x128", "lse", "fixed_m"}
  assert baselines.parse_kinds("all") == baselines.KINDS
  with pytest.raises(ValueError, match="'splosh'"):
    baselines.parse_kinds("splosh")


def test_the_key_chunk_is_passed_and_checked(capsys):
  """`--block-kv-compute` reaches the blocks ours runs with (printed in the header); one that does
  not divide the key block is refused by name before any compute."""
  bench.main(["--seq", str(T), "--heads", str(N), "--dtypes", "float32", "--interpret", "--repeats", "1",
              "--baselines", "dense", "--backend", "pallas", "--block-q", "128", "--block-kv", "256",
              "--block-kv-compute", "128"])
  out = capsys.readouterr().out
  assert "block_kv=256 block_kv_compute=128" in out and "fixed_m_gate" in out
  with pytest.raises(SystemExit):
    bench.main(["--seq", str(T), "--block-kv", "256", "--block-kv-compute", "384"])
  assert "block_kv_compute=384 must divide block_kv=256" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # the Pallas kernels' own constraint, before any compute
    bench.main(["--seq", str(T), "--backend", "pallas", "--block-kv", "256", "--block-kv-compute", "64"])
  assert "multiples of 128" in capsys.readouterr().err


@pytest.mark.parametrize("text,want", [("default", baselines.SPLASH_GRID), ("none", ()),
                                       ("4096x2048x256,1024X512x512", ((4096, 2048, 256), (1024, 512, 512)))])
def test_splash_grid_parsing(text, want):
  assert baselines.parse_grid(text) == want


@pytest.mark.parametrize("text", ["4096x2048", "0x128x128", "256x384x256", "ax1x1"])
def test_bad_splash_grids_are_refused(text):
  with pytest.raises(ValueError, match="--splash-grid entry"):
    baselines.parse_grid(text)
