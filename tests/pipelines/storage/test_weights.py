"""Loading weights: memory-mapped safetensors (`weights.open_safetensors_file`), conversion of
each device's part in one copy (`weights.HostLeaf`), direct placement on a mesh
(`distributed.put_host_leaves`, `WanPipeline.from_pretrained(mesh=...)`)."""

import json
import struct
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from attention.mesh import MeshSpec
from pipelines.storage import weights
from pipelines.parallel import distributed
from pipelines.pipeline import WanPipeline
from pipelines.wan.pretrained import saving
from pipelines.wan.transformer import large_leaf_shardings, weight_shardings


def _tensors():
  rng = np.random.default_rng(0)
  return {"f32": rng.standard_normal((3, 5)).astype(np.float32),
          "bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
          "f16": rng.standard_normal((7,)).astype(np.float16),
          "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
          "flag": np.array([True, False]),
          "empty": np.zeros((0, 4), np.float32),
          "scalar": np.array(2.5, np.float32)}


def test_mapped_file_equals_the_reference_reader(tmp_path):
  path = str(tmp_path / "w.safetensors")
  save_file(_tensors(), path)
  refs = weights.open_safetensors_file(path)
  reference = load_file(path)
  assert set(refs) == set(reference)
  for key, want in reference.items():
    got = refs[key].array()
    assert got.dtype == want.dtype and got.shape == want.shape, key
    np.testing.assert_array_equal(got, want, err_msg=key)
    assert refs[key].nbytes == want.nbytes
  mapped = refs["f32"].array()
  assert not mapped.flags.owndata and not mapped.flags.writeable  # a view of the mapping, no copy


def _rewrite(path, header=None, cut=0):
  with open(path, "rb") as f:
    data = f.read()
  n = struct.unpack("<Q", data[:8])[0]
  body = data[8 + n:]
  head = data[8:8 + n] if header is None else json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head + body[:len(body) - cut])


def test_corrupt_files_are_refused_naming_them(tmp_path):
  path = str(tmp_path / "w.safetensors")
  save_file({"a": np.ones((4, 4), np.float32), "b": np.ones((8,), np.float32)}, path)
  header = json.loads(open(path, "rb").read()[8:8 + struct.unpack("<Q", open(path, "rb").read(8))[0]])
  _rewrite(path, cut=4)
  with pytest.raises(weights.CheckpointError, match="truncated or corrupt"):
    weights.open_safetensors_file(path)
  save_file({"a": np.ones((4, 4), np.float32), "b": np.ones((8,), np.float32)}, path)
  assert header["a"]["data_offsets"] == [0, 64]
  _rewrite(path, header=dict(header, b=dict(header["b"], data_offsets=[16, 48])))  # inside a's bytes
  with pytest.raises(weights.CheckpointError, match="overlap or leave gaps"):
    weights.open_safetensors_file(path)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", 1000) + b"{}")
  with pytest.raises(weights.CheckpointError, match="header of 1000 bytes"):
    weights.open_safetensors_file(path)


def test_host_leaf_reads_converted_parts():
  rng = np.random.default_rng(1)
  layers = [rng.standard_normal((300, 260)).astype(np.float32) for _ in range(3)]  # > one copy tile
  leaf = weights.HostLeaf.stack([w.T for w in layers], ml_dtypes.bfloat16)
  want = np.stack([w.T for w in layers]).astype(ml_dtypes.bfloat16)
  assert leaf.shape == want.shape and leaf.nbytes == want.nbytes
  np.testing.assert_array_equal(leaf.read(), want)
  index = (slice(1, 3), slice(10, 200), slice(0, 130))
  part = leaf.read(index)
  assert part.flags.c_contiguous and part.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(part, want[index])
  one = weights.HostLeaf.of(layers[0].T, np.float32)
  np.testing.assert_array_equal(one.read((slice(5, 290), slice(None))), layers[0].T[5:290])
  contiguous = weights.HostLeaf.of(layers[0], np.float32)
  assert np.shares_memory(contiguous.read(), layers[0])  # same dtype, contiguous: no copy


def test_host_leaf_scales_each_output_row():
  """A scaled-fp8 weight [O, I] read through its transposed view [I, O]: each part is q * its scale (one
  per output row, broadcast to the weight and transposed as the weight is), a part without one as it is."""
  rng = np.random.default_rng(2)
  q = [rng.standard_normal((6, 5)).astype(ml_dtypes.float8_e4m3fn) for _ in range(3)]
  rows = [rng.uniform(0.5, 2.0, 6).astype(np.float32) for _ in range(3)]
  scales = [np.broadcast_to(s[:, None], (6, 5)).T for s in rows]
  leaf = weights.HostLeaf.stack([w.T for w in q], np.float32, [scales[0], None, scales[2]])
  want = np.stack([(w.astype(np.float32) * (s[:, None] if i != 1 else 1)).T for i, (w, s) in enumerate(zip(q, rows))])
  np.testing.assert_array_equal(leaf.read(), want)
  index = (slice(1, 3), slice(1, 4), slice(2, 6))
  np.testing.assert_array_equal(leaf.read(index), want[index])
  one = weights.HostLeaf.of(q[2].T, np.float32, scales[2])
  np.testing.assert_array_equal(one.read((slice(None), slice(3, 6))), want[2][:, 3:6])
  assert np.unique(rows[0]).size == 6  # the control: each row has its own scale


class _CountingLeaf(weights.HostLeaf):
  """A HostLeaf that records the indices it is read at and the bytes being read concurrently."""

  def read(self, index=()):
    with _LOCK:
      _READS.setdefault(id(self), []).append(index)
    return super().read(index)


_LOCK = threading.Lock()
_READS: dict = {}


def test_each_device_part_is_read_once_and_placed():
  mesh = MeshSpec.parse("U=2,R=2").build(jax.devices())
  rng = np.random.default_rng(2)
  src = rng.standard_normal((2, 16, 8)).astype(np.float32)
  sharded = _CountingLeaf(tuple(w.T for w in src), np.dtype(np.float32), stacked=True)  # [2, 8, 16]
  replicated = _CountingLeaf((src[0],), np.dtype(np.float32))
  _READS.clear()
  out = distributed.put_host_leaves(
      {"s": sharded, "r": replicated},
      {"s": NamedSharding(mesh, P(None, None, ("ring", "ulysses"))), "r": NamedSharding(mesh, P())})
  np.testing.assert_array_equal(np.asarray(out["s"]), np.stack([w.T for w in src]))
  np.testing.assert_array_equal(np.asarray(out["r"]), src[0])
  reads = _READS[id(sharded)]
  assert len(reads) == 4 and len({str(i) for i in reads}) == 4  # 4 distinct quarters, nothing whole
  assert all(i[2].stop - i[2].start == 4 for i in reads)
  assert len(_READS[id(replicated)]) == 1  # read once, copied to the 4 devices
  assert out["r"].sharding.is_fully_replicated and len(out["r"].addressable_shards) == 4


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
  pipe = WanPipeline.tiny(random=True)
  folder = str(tmp_path_factory.mktemp("tiny"))
  saving.save_pipeline(folder, transformer=nnx.merge(pipe._graphdef, pipe._experts[0]),
                       text_encoder=(pipe.text_encoder_config, pipe._text_params), vae=pipe.vae,
                       tokenizer=pipe.tokenizer, scheduler_config=pipe.scheduler_config)
  return folder


def test_from_pretrained_places_straight_onto_the_mesh(tiny_folder):
  spec = MeshSpec.parse("U=2,R=2", shard_weights=True)
  pipe = WanPipeline.from_pretrained(tiny_folder, mesh=spec)
  mesh = spec.build(jax.devices())
  want = jax.tree.leaves(weight_shardings(pipe._experts[0], mesh, True))
  got = jax.tree.leaves(pipe._experts[0])
  assert any(not s.is_fully_replicated for s in want)  # the check below can fail
  assert [a.sharding for a in got] == want
  text_want = jax.tree.leaves(large_leaf_shardings(pipe._text_params, mesh))
  assert [a.sharding for a in jax.tree.leaves(pipe._text_params)] == text_want
  before = [id(a) for a in got]
  call = dict(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0, seed=0,
              max_sequence_length=32, progress=False, decode=False)
  latents = pipe.run("a red square moving right", mesh=spec, **call).latents
  assert [id(a) for a in jax.tree.leaves(pipe._experts[0])] == before  # the call did not move them
  reference = WanPipeline.from_pretrained(tiny_folder).run("a red square moving right", **call).latents
  # fp32, 2 steps, latents O(1): only the sharded reductions' order differs (measured ~1e-7)
  np.testing.assert_allclose(latents, reference, atol=1e-5)


def test_from_pretrained_mesh_is_checked_before_reading(tiny_folder):
  with pytest.raises(ValueError, match="U=3|ulysses|heads"):
    WanPipeline.from_pretrained(tiny_folder, mesh="U=3")
  with pytest.raises(ValueError, match="shard_weights"):
    WanPipeline.from_pretrained(tiny_folder, shard_weights=True)


def test_file_sha256_streams_the_whole_file(tmp_path):
  """The digest of every byte, whatever the chunk size (a file of 2.5 chunks here)."""
  import hashlib

  data = np.random.default_rng(0).integers(0, 256, 5 * 1024 + 3, dtype=np.uint8).tobytes()
  (tmp_path / "f.bin").write_bytes(data)
  assert weights.file_sha256(str(tmp_path / "f.bin"), chunk=2048) == hashlib.sha256(data).hexdigest()
  assert weights.file_sha256(str(tmp_path / "f.bin")) == hashlib.sha256(data).hexdigest()
