"""The block set-up of an attention call (attention/block_layout.py): the Pallas blocks and the
unpadded operands and the output. (Its padding and masking are checked through every path in
test_blockwise.py, test_kernels.py and test_exactness.py.)"""

import numpy as np
import pytest

from attention import BlockSizes
from attention.block_layout import BlockLayout, pallas_block
from attention.padding import round_up


def test_pallas_blocks_do_not_run_a_short_query_mostly_on_padding():
  """`pallas_block`: a causal chunk's 4,680 queries in the v5e default's 4,096-row blocks would be
  8,192 rows (43 % padding); it takes 1,024-row blocks (5,120 rows). Lengths the requested block
  fits stay on it (the dense 1.3B step's 32,760; 14B's 75,600 per device at U=8), blocks stay
  multiples of 128 and powers of two when requested so, and no block is larger than asked."""
  assert pallas_block(4680, 4096) == 1024 and pallas_block(9360, 4096) == 2048
  assert pallas_block(32760, 4096) == 4096 and pallas_block(75600, 4096) == 4096 and pallas_block(32760, 1024) == 1024
  assert pallas_block(7, 1024) == 128 and pallas_block(200, 128) == 128 and pallas_block(1000, 384) == 384
  for n in range(1, 20000, 37):
    for block in (128, 384, 1024, 4096):
      b = pallas_block(n, block)
      assert b % 128 == 0 and b <= block
      if block in (1024, 4096):
        assert b & (b - 1) == 0
      halved = [c for c in (b // 2, b // 4) if c >= 128 and c % 128 == 0]
      # Padding over an eighth only where no smaller block of the halving chain pads less.
      assert round_up(n, b) - n <= n // 8 or all(round_up(n, c) >= round_up(n, b) for c in halved)
  layout = BlockLayout.make(4680, 32760, BlockSizes(4096, 1024), "pallas")
  assert (layout.T_pad, layout.S_pad) == (5120, 32768)


def test_the_key_chunk_divides_the_pallas_key_block():
  """`block_kv_compute` stays as asked when it divides the Pallas key block, follows a block that
  `pallas_block` shrank below it (gcd), is None (one chunk) when not asked, and is refused when not
  a multiple of 128 (the TPU lanes); XLA leaves it unset."""
  assert BlockLayout.make(32760, 32760, BlockSizes(4096, 2048, 512), "pallas").block_kv_compute == 512
  shrunk = BlockLayout.make(250, 250, BlockSizes(128, 1024, 512), "pallas")
  assert (shrunk.block_kv, shrunk.block_kv_compute) == (256, 256)
  assert BlockLayout.make(300, 300, BlockSizes(128, 1024), "pallas").block_kv_compute is None
  assert BlockLayout.make(300, 300, BlockSizes(128, 1024, 512)).block_kv_compute is None
  with pytest.raises(ValueError, match="multiples of 128"):
    BlockLayout.make(300, 300, BlockSizes(128, 1024, 64), "pallas")


def test_operands_unpadded_and_the_output_unpadded_token_major():
  """`queries` / `keys` only transpose to heads-major (the Pallas kernels read unpadded operands;
  `blockwise.attend` pads them for the XLA loops), and `output` drops padded rows and transposes
  back: a round trip of q gives q."""
  B, T, N, K, H = 1, 200, 4, 2, 8
  q = np.random.default_rng(0).normal(size=(B, T, N, H)).astype(np.float32)
  layout = BlockLayout.make(T, 300, BlockSizes(128, 128), "pallas")
  heads_major = layout.queries(q, K)
  assert heads_major.shape == (B, K, N // K, T, H) and layout.keys(q[:, :, :K]).shape == (B, K, T, H)
  assert np.array_equal(heads_major[0, 1, 0], q[0, :, 2])  # query head n = k * G + g
  assert np.array_equal(layout.output(heads_major), q)
  assert np.array_equal(layout.output(layout.pad_q(heads_major)), q)
  assert layout.pad_q(heads_major).shape[3] == layout.T_pad == 256
