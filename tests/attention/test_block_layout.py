"""The block set-up of an attention call (attention/block_layout.py): the Pallas blocks and the
token-major form's eligibility. (Its padding and masking are checked through every path in
test_blockwise.py, test_kernels.py and test_exactness.py.)"""

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


def test_token_major_only_for_the_kernels_and_whole_lane_heads():
  """The kernels read token-major operands in place only where a head is whole 128-lane column
  blocks (Mosaic's block shapes) and only on the Pallas backend (the XLA loops are heads-major)."""
  pallas = BlockLayout.make(1000, 1000, BlockSizes(512, 512), "pallas")
  assert pallas.token_major(128) and pallas.token_major(256)
  assert not pallas.token_major(64) and not pallas.token_major(80)
  assert not BlockLayout.make(1000, 1000, BlockSizes(512, 512), "xla").token_major(128)
