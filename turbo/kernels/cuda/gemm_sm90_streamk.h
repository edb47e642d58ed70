// How the TURBO GEMM's stream-K plan divides a problem among its persistent blocks (used by the
// kernel in gemm_sm90.cu and by the host: the plan's cost model and the CPU tests of the rules).
//
// A problem of `tiles` output tiles of `kblocks` k-iterations each, on `grid` blocks:
//   - data-parallel part: with at least two waves of tiles, the first (tiles / grid - 1) * grid
//     tiles go whole to the blocks in turn (tile t to block t % grid), as in the persistent plan;
//   - stream-K part: the k-iterations ("units") of the remaining tiles, in tile order, cut into
//     `grid` contiguous ranges of equal length (to one unit): block b takes [b*U/grid,
//     (b+1)*U/grid). A range may start or end inside a tile, so a tile can be shared by several
//     consecutive blocks. Every block then does about the same number of MMAs, whatever the
//     number of tiles (the split-k plans leave SMs idle when the clusters do not pack the GPCs).
// Fix-up of a shared tile: its "owner" is the block that holds its first k-iteration; that
// segment is the owner's last one (its range ends inside the tile). Each other block sharing the
// tile holds a later k-range of it as its *first* segment, writes that partial tile (fp32) to
// its workspace slot and raises its flag; the owner adds the partials of the blocks after it in
// block order (= k order) to its own and runs the epilogue. So a block writes at most one partial
// (one slot per block), the sums have a fixed order (a rerun of the same plan is bitwise
// identical), and an owner waits only for blocks of higher index, whose own waits (if any) come
// after their partials are written: no cycle, and the highest-numbered block never waits.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PRIMUS_SK_HD __host__ __device__ __forceinline__
#else
#define PRIMUS_SK_HD inline
#endif

namespace primus::turbo::cuda::streamk {

struct Split {
  int tiles = 0, kblocks = 0, grid = 0;
  int tiles_dp = 0;   // tiles done whole, data-parallel, before the stream-K part
  int64_t units = 0;  // k-iterations of the stream-K part: (tiles - tiles_dp) * kblocks

  PRIMUS_SK_HD int64_t begin(int b) const { return static_cast<int64_t>(b) * units / grid; }
  PRIMUS_SK_HD int64_t end(int b) const { return begin(b + 1); }
  // The block whose range holds unit u (0 <= u < units): the largest b with begin(b) <= u.
  PRIMUS_SK_HD int block_of(int64_t u) const {
    return static_cast<int>(((u + 1) * grid + units - 1) / units - 1);
  }
};

// One stretch of a block's stream-K range inside one tile: k-iterations [kb_begin, kb_end) of
// tile `tile` (an index into the whole problem's tile order, data-parallel tiles included).
struct Segment {
  int tile = 0, kb_begin = 0, kb_end = 0;
};

// The segment starting at unit u (begin(b) <= u < end(b)) of block b.
PRIMUS_SK_HD Segment segment_at(const Split& s, int b, int64_t u) {
  const int64_t t = u / s.kblocks;
  const int kbs = static_cast<int>(u - t * s.kblocks);
  const int64_t left = s.end(b) - u;
  Segment g;
  g.tile = s.tiles_dp + static_cast<int>(t);
  g.kb_begin = kbs;
  g.kb_end = static_cast<int>(left < s.kblocks - kbs ? kbs + left : s.kblocks);
  return g;
}

// The last block holding a k-iteration of stream-K tile `tile` (tiles_dp <= tile < tiles).
PRIMUS_SK_HD int last_block_of_tile(const Split& s, int tile) {
  return s.block_of(static_cast<int64_t>(tile - s.tiles_dp + 1) * s.kblocks - 1);
}

// The split of `tiles` tiles of `kblocks` k-iterations over `grid` blocks (grid >= 1); grid is
// lowered to the stream-K units when there are fewer (every block gets at least one).
inline Split make_split(int tiles, int kblocks, int grid) {
  Split s;
  s.tiles = tiles;
  s.kblocks = kblocks;
  s.grid = grid;
  s.tiles_dp = tiles >= 2 * grid ? (tiles / grid - 1) * grid : 0;
  s.units = static_cast<int64_t>(tiles - s.tiles_dp) * kblocks;
  if (s.units < s.grid) s.grid = static_cast<int>(s.units);
  return s;
}

}  // namespace primus::turbo::cuda::streamk

#undef PRIMUS_SK_HD
