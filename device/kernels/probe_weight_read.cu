// How fast the card reads the experts' FP8 weights, against bytes in flight (issue 44, item 4): the weight loader
// of the persistent decode consumer, alone. benchmarks/probe_weight_read.py sweeps it and checks every byte.
//
//   probe_weight_read  one block per SM: a loader warp streams the selected experts' w13 and w2 tiles into a ring
//                      of `stages` shared-memory stages (chunkring/util/stage_pipeline.cuh); two consumer
//                      warpgroups add every 4-byte word of each stage into a checksum and release it
//   probe_plain_read   the baseline: every thread keeps kPlainUnroll 16-byte loads in flight, no shared memory
//
// The weights: w13 [E, 2I, H] and w2 [E, H, I] e4m3, row-major (chunkring.moe.Fp8Weight's data). The experts read
// are experts[0 .. num_read); each one's w13 and then its w2 are cut into tiles of box_rows x box_cols bytes,
// numbered expert by expert, w13's tiles row by row then w2's (tile_of below). How a tile travels (`loader`):
//   kTensor2d  one 2-D tensor-map copy of the box (`cp.async.bulk.tensor`; w13_map / w2_map view each weight as
//              [E * rows, cols] with a box_cols x box_rows box)
//   kFlat      one 1-D bulk copy of box_rows * box_cols contiguous bytes (the layout a pre-tiled copy of the
//              weights would have): the tile's bytes are then those of its index in the matrix, not a box
//   kRows      box_rows 1-D bulk copies of box_cols bytes, one per row of the box, spread over the warp's lanes
// Every loader covers each byte of the experts read exactly once, so every loader's checksum is the same: the sum
// of the weights' 4-byte words modulo 2^32, whatever order the tiles are read in.
//
// Which block reads which tile (`claim`): kStrided tiles blockIdx.x, + gridDim.x, ...; kBlocked one contiguous
// share of the tiles per block; kAtomic each tile from a global counter (claim_counter, zero at launch), claimed
// one tile ahead so that the atomic's round trip overlaps the wait for a free stage.
//
// out: per block kRecordWords words (kChecksum .. kMark below); the host sums the checksums and checks every block
// wrote its record.
#include <cuda_fp8.h>

#include <cuda/std/cstdint>

#include "chunkring/moe/probe_args.cuh"
#include "chunkring/ptx/bulk_copy.cuh"
#include "chunkring/ptx/mbarrier.cuh"
#include "chunkring/ptx/ordering.cuh"
#include "chunkring/ptx/warpgroup.cuh"
#include "chunkring/util/kernel_params.cuh"
#include "chunkring/util/stage_pipeline.cuh"

using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::moe::ProbeWeightReadArgs;
using chunkring::ptx::TensorMap;

namespace {

namespace ptx = chunkring::ptx;
namespace util = chunkring::util;
using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

constexpr u32 kWarp = 32;
constexpr u32 kConsumerWarps = 8;                  // two warpgroups, as the decode consumer's math warpgroups
constexpr u32 kConsumerThreads = kConsumerWarps * kWarp;
constexpr u32 kThreads = kConsumerThreads + 128;   // + the loader's warpgroup (its first warp loads)
constexpr u32 kLoaderWarp = kConsumerWarps;
// Registers per thread after the warpgroups trade (DeepGEMM's SM90 split for 384 threads): 128 x 40 + 256 x 232
// is the 384 x 168 that ptxas allocates at entry under __launch_bounds__(kThreads, 1).
constexpr int kLoaderRegisters = 40, kConsumerRegisters = 232;
static_assert(128 * kLoaderRegisters + kConsumerThreads * kConsumerRegisters <= 65536, "one block per SM");
// The stage ring's alignment: a 128-byte-swizzled tensor-map copy needs its destination on 1024 bytes.
constexpr u32 kStageAlign = 1024;

constexpr int kTensor2d = 0, kFlat = 1, kRows = 2;       // loader; append-only, probe_weight_read.py LOADERS
constexpr int kStrided = 0, kBlocked = 1, kAtomic = 2;   // claim; append-only, probe_weight_read.py CLAIMS
constexpr u32 kEnd = 0xffffffffu;                        // the tile of the stage that ends the ring

// Words of a block's record in `out`: the checksum (sum of the words it read, mod 2^32), the tiles and bytes it
// read, its SM, and global-timer times: start, first stage landed, end.
constexpr u32 kRecordWords = 8;
constexpr u32 kChecksum = 0, kTiles = 1, kBytes = 2, kSm = 3, kStartNs = 4, kFirstNs = 5, kEndNs = 6, kMark = 7;
constexpr u64 kRecordMark = 0x7765696768747321ull;  // written last: the block's record is complete

// The plain baseline: kPlainThreads threads, each with kPlainUnroll 16-byte loads in flight, read one 64 KB flat
// tile per block and iteration.
constexpr u32 kPlainThreads = 512, kPlainUnroll = 8;
constexpr u32 kPlainTileBytes = kPlainThreads * kPlainUnroll * 16;

// The experts' tiles: per expert read, w13's (2I / box_rows) x (H / box_cols) tiles, then w2's (H / box_rows) x
// (I / box_cols).
struct Tiling {
    u64 w13_rows, w13_cols, w2_rows, w2_cols;  // one expert's matrices
    u32 box_rows, box_cols;
    __device__ __forceinline__ u32 col_tiles(u32 matrix) const {
        return static_cast<u32>((matrix == 0 ? w13_cols : w2_cols) / box_cols);
    }
    __device__ __forceinline__ u32 matrix_tiles(u32 matrix) const {
        return static_cast<u32>((matrix == 0 ? w13_rows : w2_rows) / box_rows) * col_tiles(matrix);
    }
    __device__ __forceinline__ u32 per_expert() const { return matrix_tiles(0) + matrix_tiles(1); }
    __device__ __forceinline__ u32 box_bytes() const { return box_rows * box_cols; }
};

// Tile t: the expert read (its index into experts), the matrix (0: w13, 1: w2) and the tile's index in it.
struct Tile {
    u32 slot, matrix, index;
};

__device__ __forceinline__ Tile tile_of(const Tiling& g, u32 t) {
    const u32 per = g.per_expert(), within = t % per, w13 = g.matrix_tiles(0);
    return within < w13 ? Tile{t / per, 0, within} : Tile{t / per, 1, within - w13};
}

// The claims: the block's first tile, then each next one (kAtomic: lane 0's claim, broadcast to the warp).
__device__ __forceinline__ u32 blocked_begin(u32 total, u32 block) {
    return static_cast<u32>(static_cast<u64>(total) * block / gridDim.x);
}

__device__ __forceinline__ u32 next_static(int claim, u32 tile, u32 total) {
    if (claim == kStrided) return tile + gridDim.x;
    return tile + 1 < blocked_begin(total, blockIdx.x + 1) ? tile + 1 : total;
}

// The two matrices (0: w13, 1: w2), each picked by a select: an array indexed at run time would live in local memory.
struct Weights {
    const TensorMap* w13_map;
    const TensorMap* w2_map;
    const unsigned char* w13;
    const unsigned char* w2;
    __device__ __forceinline__ const TensorMap* map(u32 matrix) const { return matrix == 0 ? w13_map : w2_map; }
    __device__ __forceinline__ const unsigned char* base(u32 matrix) const { return matrix == 0 ? w13 : w2; }
};

// The loader warp: every lane runs the loop (kRows spreads a tile's rows over them); lane 0 claims, arrives and
// issues the single copy of the other loaders.
__device__ void load(util::StagePipeline& pipe, u32* stage_tile, unsigned char* ring, const Weights& w,
                     const int* experts, const Tiling& g, u32 total, u32 stages, int loader, int claim,
                     unsigned* claim_counter, u64 limit_ns) {
    const u32 lane = threadIdx.x % kWarp, bytes = g.box_bytes();
    if (lane == 0) {
        ptx::prefetch_tensormap(w.w13_map);
        ptx::prefetch_tensormap(w.w2_map);
    }
    u32 tile = claim == kStrided  ? blockIdx.x
               : claim == kBlocked ? blocked_begin(total, blockIdx.x)
                                   : __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(claim_counter, 1u) : 0u, 0);
    if (claim == kBlocked && tile >= blocked_begin(total, blockIdx.x + 1)) tile = total;
    util::Cursor c;
    while (tile < total) {
        u32 ahead = 0;
        if (claim == kAtomic && lane == 0) ahead = atomicAdd(claim_counter, 1u);  // used after the wait below
        pipe.acquire(c, limit_ns);
        const Tile t = tile_of(g, tile);
        const u64 expert = static_cast<u64>(experts[t.slot]);
        const u64 rows = t.matrix == 0 ? g.w13_rows : g.w2_rows, cols = t.matrix == 0 ? g.w13_cols : g.w2_cols;
        const u32 col_tiles = g.col_tiles(t.matrix);
        const u64 row0 = expert * rows + static_cast<u64>(t.index / col_tiles) * g.box_rows;  // box's first row
        const u64 col0 = static_cast<u64>(t.index % col_tiles) * g.box_cols;
        unsigned char* dst = ring + static_cast<u64>(c.stage) * bytes;
        if (lane == 0) {
            stage_tile[c.stage] = tile;
            pipe.commit(c, bytes);
        }
        __syncwarp();  // the transaction count is announced before any of the lanes' copies can land
        if (loader == kTensor2d) {
            if (lane == 0)
                ptx::copy_tile_2d(dst, w.map(t.matrix), static_cast<int>(col0), static_cast<int>(row0),
                                  pipe.full_of(c));
        } else if (loader == kFlat) {
            if (lane == 0)
                ptx::copy_bulk(dst, w.base(t.matrix) + expert * rows * cols + static_cast<u64>(t.index) * bytes, bytes,
                               pipe.full_of(c));
        } else if (loader == kRows) {
            for (u32 r = lane; r < g.box_rows; r += kWarp)
                ptx::copy_bulk(dst + r * g.box_cols, w.base(t.matrix) + (row0 + r) * cols + col0, g.box_cols,
                               pipe.full_of(c));
        }
        c.advance(stages);
        tile = claim == kAtomic ? __shfl_sync(0xffffffffu, ahead, 0) : next_static(claim, tile, total);
    }
    pipe.acquire(c, limit_ns);  // the end marker takes a stage like a tile
    if (lane == 0) {
        stage_tile[c.stage] = kEnd;
        pipe.commit(c, 0);
    }
}

// A consumer thread: adds every word of each stage (16 bytes per thread and step, consecutive across the warp:
// no bank conflicts) until the end marker. Returns its partial checksum; tiles counts the stages it saw.
__device__ u32 consume(util::StagePipeline& pipe, const u32* stage_tile, const unsigned char* ring, u32 bytes,
                       u32 stages, u64 limit_ns, u32& tiles, u64& first_ns) {
    const u32 lane = threadIdx.x % kWarp;
    u32 sum = 0;
    tiles = 0;
    util::Cursor c;
    for (;;) {
        pipe.wait(c, limit_ns);
        if (tiles == 0 && threadIdx.x == 0) first_ns = ptx::globaltimer_ns();
        if (stage_tile[c.stage] == kEnd) break;
        const auto* v = reinterpret_cast<const uint4*>(ring + static_cast<u64>(c.stage) * bytes);
        for (u32 i = threadIdx.x; i < bytes / 16; i += kConsumerThreads) {
            const uint4 x = v[i];
            sum += x.x + x.y + x.z + x.w;
        }
        __syncwarp();  // every lane's reads are done (their values added) before the warp releases the stage
        if (lane == 0) pipe.release(c);
        ++tiles;
        c.advance(stages);
    }
    return sum;
}

// The block's record: the consumers' sums through one shared word, written by thread 0 after a block barrier.
__device__ __forceinline__ u32 warp_sum(u32 v) {
#pragma unroll
    for (u32 offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ void write_record(unsigned long long* out, u32 checksum, u64 tiles, u64 bytes, u64 start_ns,
                                             u64 first_ns) {
    unsigned long long* r = out + static_cast<u64>(blockIdx.x) * kRecordWords;
    r[kChecksum] = checksum;
    r[kTiles] = tiles;
    r[kBytes] = bytes;
    r[kSm] = ptx::sm_id();
    r[kStartNs] = start_ns;
    r[kFirstNs] = first_ns;
    r[kEndNs] = ptx::globaltimer_ns();
    r[kMark] = kRecordMark;
}

}  // namespace

// The weight loader alone. Launch: grid <= the SM count (one block per SM: the registers allow no second),
// block kThreads (384), stages * box_rows * box_cols + kStageAlign bytes of dynamic shared memory.
//   w13_map, w2_map: chunkring.jit.tensor_map tiled maps of w13 viewed as [E * 2I, H] and w2 as [E * H, I], uint8,
//     box box_cols x box_rows (read only by kTensor2d, always passed); the rest in args (moe/probe_args.cuh):
//   w13 [E, 2I, H], w2 [E, H, I] e4m3; experts [num_read] int32, each in [0, E)
//   box_rows, box_cols: box_rows divides 2I and H, box_cols divides H and I, box_cols % 16 == 0, box_rows <= 256;
//     box_rows * box_cols a multiple of kStageAlign
//   stages in [1, kMaxStages]; loader kTensor2d / kFlat / kRows; claim kStrided / kBlocked / kAtomic (claim_counter
//     then an int32 word, zero at launch; otherwise null)
//   wait_limit_ns: how long a stage wait may take before the block prints and traps
//   out [grid, kRecordWords] uint64
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    probe_weight_read(const __grid_constant__ TensorMap w13_map, const __grid_constant__ TensorMap w2_map,
                      const __grid_constant__ ProbeWeightReadArgs args) {
    require_args(args);
    const auto* w13 = arg<const __nv_fp8_e4m3*>(args.w13);
    const auto* w2 = arg<const __nv_fp8_e4m3*>(args.w2);
    const auto* experts = arg<const int*>(args.experts);
    const int num_read = arg<int>(args.num_read);
    const long long hidden = arg<long long>(args.hidden);
    const long long inter = arg<long long>(args.inter);
    const int box_rows = arg<int>(args.box_rows);
    const int box_cols = arg<int>(args.box_cols);
    const int stages = arg<int>(args.stages);
    const int loader = arg<int>(args.loader);
    const int claim = arg<int>(args.claim);
    auto* claim_counter = arg<unsigned*>(args.claim_counter);  // null but for kAtomic
    const long long wait_limit_ns = arg<long long>(args.wait_limit_ns);
    auto* out = arg<unsigned long long*>(args.out);
    __shared__ util::StagePipeline pipe;
    __shared__ u32 stage_tile[util::kMaxStages];
    __shared__ u32 block_sum;
    extern __shared__ unsigned char dynamic_shared[];
    const u64 start_ns = ptx::globaltimer_ns();
    const u32 warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const u64 H = static_cast<u64>(hidden), I = static_cast<u64>(inter);
    const Tiling g{2 * I, H, H, I, static_cast<u32>(box_rows), static_cast<u32>(box_cols)};
    const u32 total = static_cast<u32>(num_read) * g.per_expert(), depth = static_cast<u32>(stages);
    const u64 limit_ns = static_cast<u64>(wait_limit_ns);
    // The ring on a kStageAlign boundary of the dynamic shared memory (the launch adds kStageAlign bytes).
    const u32 base = ptx::shared_address(dynamic_shared);
    unsigned char* ring = dynamic_shared + ((base + kStageAlign - 1) / kStageAlign * kStageAlign - base);
    if (threadIdx.x == 0) {
        pipe.init(depth, kConsumerWarps);
        block_sum = 0;
    }
    __syncthreads();
    u32 sum = 0, tiles = 0;
    u64 first_ns = 0;
    if (warp >= kConsumerWarps) {  // the loader's warpgroup: one warp loads, three idle
        ptx::setmaxnreg_dec<kLoaderRegisters>();
        if (warp == kLoaderWarp)
            load(pipe, stage_tile, ring,
                 Weights{&w13_map, &w2_map, reinterpret_cast<const unsigned char*>(w13),
                         reinterpret_cast<const unsigned char*>(w2)},
                 experts, g, total, depth, loader, claim, claim_counter, limit_ns);
    } else {
        ptx::setmaxnreg_inc<kConsumerRegisters>();
        sum = consume(pipe, stage_tile, ring, g.box_bytes(), depth, limit_ns, tiles, first_ns);
        sum = warp_sum(sum);
        if (lane == 0) atomicAdd(&block_sum, sum);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        write_record(out, block_sum, tiles, static_cast<u64>(tiles) * g.box_bytes(), start_ns, first_ns);
}

// The baseline without the copy engine: the same experts' bytes in kPlainTileBytes flat tiles, strided over the
// blocks, each thread's kPlainUnroll 16-byte loads issued before any is used. Launch: block kPlainThreads (512), any
// grid (the SM count times the blocks an SM holds); the matrices' sizes multiples of kPlainTileBytes.
//   w13, w2, experts, num_read, hidden, inter: as probe_weight_read; out [grid, kRecordWords] uint64
extern "C" __global__ void __launch_bounds__(kPlainThreads, 2)
    probe_plain_read(const __nv_fp8_e4m3* w13, const __nv_fp8_e4m3* w2, const int* experts, int num_read,
                     long long hidden, long long inter, unsigned long long* out) {
    __shared__ u32 block_sum;
    const u64 start_ns = ptx::globaltimer_ns();
    const u64 H = static_cast<u64>(hidden), I = static_cast<u64>(inter);
    const u64 w13_bytes = 2 * I * H, w2_bytes = H * I;
    const u32 per = static_cast<u32>((w13_bytes + w2_bytes) / kPlainTileBytes);
    const u32 w13_tiles = static_cast<u32>(w13_bytes / kPlainTileBytes);
    const u32 total = static_cast<u32>(num_read) * per;
    if (threadIdx.x == 0) block_sum = 0;
    __syncthreads();
    u32 sum = 0, tiles = 0;
    for (u32 tile = blockIdx.x; tile < total; tile += gridDim.x, ++tiles) {
        const u32 within = tile % per;
        const u64 expert = static_cast<u64>(experts[tile / per]);
        const unsigned char* tile_start =
            within < w13_tiles ? reinterpret_cast<const unsigned char*>(w13) + expert * w13_bytes +
                                     static_cast<u64>(within) * kPlainTileBytes
                               : reinterpret_cast<const unsigned char*>(w2) + expert * w2_bytes +
                                     static_cast<u64>(within - w13_tiles) * kPlainTileBytes;
        const auto* v = reinterpret_cast<const uint4*>(tile_start);
        uint4 x[kPlainUnroll];
#pragma unroll
        for (u32 u = 0; u < kPlainUnroll; ++u) x[u] = __ldg(v + threadIdx.x + u * kPlainThreads);
#pragma unroll
        for (u32 u = 0; u < kPlainUnroll; ++u) sum += x[u].x + x[u].y + x[u].z + x[u].w;
    }
    sum = warp_sum(sum);
    if (threadIdx.x % kWarp == 0) atomicAdd(&block_sum, sum);
    __syncthreads();
    if (threadIdx.x == 0)
        write_record(out, block_sum, tiles, static_cast<u64>(tiles) * kPlainTileBytes, start_ns, start_ns);
}
