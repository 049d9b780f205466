"""The whole-pipeline AOT report's parts that run without libtpu: the stage list, the VAE decode
programs (compiled here for CPU devices), the distinct-convolution count that a TPU compile pays
for, and the compile-cache status. The TPU numbers themselves are in docs/measurements/tpu-stages.md."""

import logging
import warnings

import jax
import pytest

from end_to_end.aot import stages as aot_stages, vae as aot_vae
from end_to_end.bench import pipeline as bench_pipeline
from pipelines.wan.vae import effort as vae_effort, model as V, VAE_PRESETS


def test_stages_are_checked_before_any_compile(capsys):
  assert aot_stages.parse_stages("text,decode") == ["text", "decode"]
  for bad in ("vae", "", "step,encode"):
    with pytest.raises(ValueError, match="comma-separated from text, step, decode"):
      aot_stages.parse_stages(bad)
  assert bench_pipeline.main(["--aot", "v6e:2x4", "--stages", "step,vae"]) == 2
  assert "--stages 'step,vae'" in capsys.readouterr().err


def test_distinct_convolutions_counts_repeats_once():
  line = ('%0 = stablehlo.convolution(%a, %b) dim_numbers = [b, 0, 1, f], window = {pad = [[0, 0]]} : '
          '(tensor<1x8x8x4xf32>, tensor<3x3x4x4xf32>) -> tensor<1x8x8x4xf32>')
  other = line.replace("pad = [[0, 0]]", "pad = [[1, 1]]")
  assert aot_vae.distinct_convolutions("\n".join([line, line, other, "%1 = stablehlo.add"])) == (3, 2)


def test_estimated_cycles_sums_the_tpu_cost_model_and_is_absent_elsewhere():
  """libtpu writes its cost model's estimate into each scheduled instruction's backend config (the
  two lines are cut from a compiled v6e convolution); XLA:CPU writes none."""
  from end_to_end.aot import collectives, step as aot_step

  tpu = ('%pad = bf16[6,722,1,1288,96]{1,4,3,2,0:T(8,128)(2,1)} pad(%bitcast, %constant), '
         'backend_config={"flag_configs":[],"estimated_cycles":"202891","used_scoped_memory_configs":[]}\n'
         '%copy.3 = bf16[1,4,720,1280,96]{3,4,2,1,0:T(8,128)(2,1)} copy(%fusion), '
         'backend_config={"flag_configs":[],"estimated_cycles":"7353600"}')
  assert collectives.estimated_cycles(tpu) == 202891 + 7353600
  compiled = jax.jit(lambda x: x * 2).lower(jax.numpy.ones(4)).compile()
  assert collectives.estimated_cycles(compiled.as_text()) is None
  assert "estimated_cycles" not in aot_step.compiled_analysis(compiled)


def _upsamplers(config):
  return sum(1 for layer in config.decoder_layers() if type(layer).__name__ == "Resample")


def test_each_upsample_is_one_distinct_convolution_for_the_tpu():
  """The TPU lowering of the later-chunk decode: each upsampler's four output phases run one and the
  same convolution (same shapes and padding, their own kernels), and the 1x1 / time-only kernels are
  matmuls, so the program holds 10 distinct convolutions (25 before: a TPU compile pays per
  distinct one)."""
  config = VAE_PRESETS["wan2.1"]
  vae = aot_vae.abstract_vae(config, jax.numpy.bfloat16)
  z = jax.ShapeDtypeStruct((1, 1, 60, 104, config.z_dim), jax.numpy.bfloat16)
  programs = V._chunk_programs(vae_effort.decode_compile_effort("tpu"))
  _, cache = jax.eval_shape(programs.first, vae, z)
  text = programs.later.trace(vae, cache, z).lower(lowering_platforms=("tpu",)).as_text()
  two_by_two = [line for line in text.splitlines() if "stablehlo.convolution" in line and "tensor<1x2x2x" in line]
  assert len(two_by_two) == 4 * _upsamplers(config) == 12
  assert aot_vae.distinct_convolutions("\n".join(two_by_two)) == (12, 3)  # one kind per upsampler
  assert aot_vae.distinct_convolutions(text) == (42, 10)
  assert "stablehlo.dot_general" in text  # the pointwise kernels


def test_decode_programs_split_over_devices_move_only_halo_rows():
  rows = aot_vae.compile_vae_decode(jax.devices()[:2], height=40, width=32, vae="tiny", dtype="float32", split=True,
                                    programs=("first",))
  assert [r["program"] for r in rows] == ["first"]
  for r in rows:
    assert r["compile_effort"] == 0.0  # the pipeline's on CPU
    assert r["stage"] == "decode" and r["devices"] == 2 and r["split"]
    assert r["collectives"]["collective-permute"]["count"] > 0
    assert r["collectives"]["all-gather"]["count"] == 0 and r["collectives"]["all-to-all"]["count"] == 0
    assert r["memory_analysis"]["argument_size_in_bytes"] > 0 and r["compile_s"] > 0
    assert "failed" not in aot_stages.format_decode_row(dict(r, cache="off"))
  with pytest.raises(ValueError, match="multiples of 8"):
    aot_vae.compile_vae_decode(jax.devices()[:1], height=44, width=32, vae="tiny")


def test_cache_status_reads_jax_own_hit_and_miss_lines(tmp_path):
  log = logging.getLogger("jax._src.compiler")

  def compile_logging(*lines):
    def fn():
      for line in lines:
        log.debug(line)
      return "compiled"
    return fn

  miss = "PERSISTENT COMPILATION CACHE MISS for 'jit_f' with key 'k'"
  hit = "Persistent compilation cache hit for 'jit_f' with key 'k'"
  assert aot_stages.with_cache_status(None, compile_logging(miss)) == ("compiled", "off")
  assert aot_stages.with_cache_status(str(tmp_path), compile_logging(miss)) == ("compiled", "written")
  assert aot_stages.with_cache_status(str(tmp_path), compile_logging(hit)) == ("compiled", "entry found")
  assert aot_stages.with_cache_status(str(tmp_path), compile_logging(hit, miss.replace("jit_f", "jit_g")))[1] == "mixed"

  def found_but_not_loadable():  # what a compile-only TPU client does with a found entry
    warnings.warn("Error reading persistent compilation cache entry for 'jit_f': JaxRuntimeError: ...")
    log.debug(miss)

  assert aot_stages.with_cache_status(str(tmp_path), found_but_not_loadable)[1] == "entry found"
