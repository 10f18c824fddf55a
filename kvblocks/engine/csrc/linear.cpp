// Linear layers of few rows over bfloat16 weights packed once: the CPU kernel behind
// `kvblocks.engine.head`'s bfloat16 layers where this CPU has AVX512-BF16.
//
// A decode step of a batch of B requests multiplies B rows (B <= 16 or so) by every weight of the
// model once: the product reads far more weight bytes than it does arithmetic on each, so it runs at
// the rate the weights stream in from memory, if the arithmetic keeps up. oneDNN's bfloat16 product
// at 16 rows does not (about 0.4 of the memory's bandwidth on one thread); here the 16 rows are the
// 16 lanes of a vector: one `vdpbf16ps` multiplies a pair of weights, broadcast from memory, by that
// pair of inputs of all 16 rows and adds the two products into each row's float32 sum. The weights
// are read once, in the order they lie, as 4-byte broadcasts: 4 weight bytes per instruction.
//
// Packed layout. The weight [n, k] (k even) is cut into blocks of `kCols` output columns (the last
// one padded with zero weights); a block holds, for each pair of input columns p, the pairs
// (w[c][2p], w[c][2p + 1]) of its kCols columns c in order: [n / kCols][k / 2][kCols][2].
//
// Exactness and batch invariance. An output (row, column) is one float32 sum over k / 2 pair-products
// in order of p, in its own vector lane, then the bias added and rounded to bfloat16 (to nearest,
// ties to even, by `vcvtneps2bf16`). Every lane runs the same instructions, so a row's result depends only on its own
// inputs and the weights: not on the other rows of the call, how many there are, or which lane it
// took. Row tiles of 16 are computed one after another, each the same way; a sum is kept in float32
// between chunks of input pairs (stored and loaded exactly), so chunking changes nothing.

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVB_HAVE_BF16 1
#endif

namespace {

constexpr int64_t kCols = 24;  // accumulators: one per output column of a block (of 32 registers)
constexpr int64_t kRows = 16;  // rows per tile: the lanes of a float32 vector
// Input pairs of a block run over all row tiles before the next ones (24 KB of weights, in the first
// level cache while the tiles re-read them); a lane's sum still adds its pairs in order of p.
constexpr int64_t kChunk = 256;
constexpr int64_t kAhead = 4096;  // int32 elements (16 KB) of the weight stream prefetched ahead

inline float widen(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}


#ifdef KVB_HAVE_BF16
// One tile of up to 16 rows by one block of kCols columns, over the input pairs p0 .. p1 - 1: `xt`
// the tile's input pairs, lane-major ([k / 2][16] int32), `w` the block ([k / 2][kCols] int32
// pairs). The sums start at zero (`first`) or from `state` ([kCols][16] float32, where the previous
// pairs left them) and go back there, or (`last`) have `bias` (the block's kCols biases, float32,
// zero where none) added and are written to out[j][r], column j of row r, rounded to bfloat16. Each
// multiply-add reads its weight pair as a broadcast memory operand (one instruction where the
// intrinsics compile to a broadcast and a multiply-add), so the accumulators are named one by one.
#define KVB_ACC(J) __m512 a##J = _mm512_setzero_ps();
#define KVB_LOAD(J) a##J = _mm512_load_ps(state + J * kRows);
#define KVB_SAVE(J) _mm512_store_ps(state + J * kRows, a##J);
#define KVB_DP(J) __asm__("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(a##J) : "m"(wp[J]), "v"(x));
#define KVB_OUT(J) \
  _mm256_store_si256((__m256i*)(out + J * kRows), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a##J, _mm512_set1_ps(bias[J]))));
#define KVB_24(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) \
  M(12) M(13) M(14) M(15) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23)
static_assert(kCols == 24, "KVB_24 names kCols accumulators");

inline void tile(const int32_t* xt, const int32_t* w, int64_t p0, int64_t p1, float* state, bool first,
                 bool last, bool fetch, const float* bias, uint16_t* out) {
  KVB_24(KVB_ACC)
  if (!first) {
    KVB_24(KVB_LOAD)
  }
  for (int64_t p = p0; p < p1; ++p) {
    const __m512 x = _mm512_load_ps(reinterpret_cast<const float*>(xt + p * kRows));
    const int32_t* wp = w + p * kCols;
    if (fetch) {
      _mm_prefetch((const char*)(wp + kAhead), _MM_HINT_NTA);
      _mm_prefetch((const char*)(wp + kAhead + 16), _MM_HINT_NTA);
    }
    KVB_24(KVB_DP)
  }
  if (last) {
    KVB_24(KVB_OUT)
  } else {
    KVB_24(KVB_SAVE)
  }
}
#endif

}  // namespace

extern "C" {

// Elements (uint16) of the packed weight of an [n, k] weight.
int64_t kvb_linear_packed_size(int64_t n, int64_t k) { return (n + kCols - 1) / kCols * kCols * k; }

// Pack `w` ([n, k] bfloat16, rows `w_stride` apart) into `out` (kvb_linear_packed_size elements).
// Returns 0, or 1 where k is odd.
int kvb_linear_pack_bf16(const uint16_t* w, int64_t n, int64_t k, int64_t w_stride, uint16_t* out) {
  if (k % 2) return 1;
  const int64_t pairs = k / 2, blocks = (n + kCols - 1) / kCols;
  int32_t* o = reinterpret_cast<int32_t*>(out);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < kCols; ++j) {
        const int64_t c = b * kCols + j;
        int32_t pair = 0;
        if (c < n) std::memcpy(&pair, w + c * w_stride + 2 * p, 4);
        o[(b * pairs + p) * kCols + j] = pair;
      }
  return 0;
}

// y[m, n] = x[m, k] @ w.T + bias (bias may be null), all bfloat16, float32 sums; x rows `x_stride`
// apart (k contiguous), y rows `y_stride` apart. Returns 0; 1 where k is odd; 2 where this build
// has no AVX512-BF16; 3 where its buffers (the inputs once more, in float32 sums of 16 x 24) cannot
// be allocated.
int kvb_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                    int64_t n, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
  if (k % 2) return 1;
#ifndef KVB_HAVE_BF16
  (void)x, (void)m, (void)x_stride, (void)packed, (void)n, (void)bias, (void)y, (void)y_stride;
  return 2;
#else
  const int64_t pairs = k / 2, blocks = (n + kCols - 1) / kCols;
  const int64_t tiles = (m + kRows - 1) / kRows;
  // every tile's inputs, lane-major: xt[t][p][r] = the pair (x[16 t + r][2p], x[16 t + r][2p + 1])
  int32_t* xt = static_cast<int32_t*>(_mm_malloc(sizeof(int32_t) * tiles * pairs * kRows, 64));
  if (xt == nullptr) return 3;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t row = t * kRows + r;
      int32_t* dst = xt + t * pairs * kRows + r;
      if (row < m) {
        const uint16_t* src = x + row * x_stride;
        for (int64_t p = 0; p < pairs; ++p) std::memcpy(dst + p * kRows, src + 2 * p, 4);
      } else {
        for (int64_t p = 0; p < pairs; ++p) dst[p * kRows] = 0;
      }
    }
  alignas(64) uint16_t block[kCols * kRows];  // a tile's outputs, column-major
  alignas(64) float biases[kCols];
  // Block after block, each over its pairs chunk by chunk, every row tile over a chunk while the
  // chunk's weights are in the first level cache: each block's weights read from memory once.
  float* state = static_cast<float*>(_mm_malloc(sizeof(float) * tiles * kCols * kRows, 64));
  if (state == nullptr) {
    _mm_free(xt);
    return 3;
  }
  const int32_t* w = reinterpret_cast<const int32_t*>(packed);
  auto step = [&](int64_t b, int64_t p0, int64_t t, float* st, bool fetch) {
    const int64_t c0 = b * kCols, cols = n - c0 < kCols ? n - c0 : kCols;
    const int64_t p1 = pairs - p0 < kChunk ? pairs : p0 + kChunk;
    if (p1 == pairs)  // the block's biases, for the sums' last pairs
      for (int64_t j = 0; j < kCols; ++j) biases[j] = bias != nullptr && j < cols ? widen(bias[c0 + j]) : 0.0f;
    tile(xt + t * pairs * kRows, w + b * pairs * kCols, p0, p1, st, p0 == 0, p1 == pairs, fetch, biases, block);
    if (p1 < pairs) return;
    const int64_t rows = m - t * kRows < kRows ? m - t * kRows : kRows;
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* out = y + (t * kRows + r) * y_stride + c0;
      for (int64_t j = 0; j < cols; ++j) out[j] = block[j * kRows + r];
    }
  };
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t p0 = 0; p0 < pairs; p0 += kChunk)
      for (int64_t t = 0; t < tiles; ++t) step(b, p0, t, state + t * kCols * kRows, t == 0);
  _mm_free(state);
  _mm_free(xt);
  return 0;
#endif
}

// The core's rate of the kernel's instruction: `rounds` x 24 independent `vdpbf16ps` (kind 0) or
// `vfmadd231ps` (kind 1, the float32 product's) on zmm registers, each with a broadcast memory
// operand as the kernel's, and nothing else. What a product of 16 rows can reach at most: 4 weight
// bytes per instruction in either dtype. Returns 0, or 2 where this build has no AVX512-BF16.
int kvb_linear_peak(int64_t rounds, int kind) {
#ifndef KVB_HAVE_BF16
  (void)rounds, (void)kind;
  return 2;
#else
  alignas(64) static const int32_t ones[kCols] = {};
  const int32_t* wp = ones;
  const __m512 x = _mm512_setzero_ps();
  KVB_24(KVB_ACC)
#define KVB_FMA(J) __asm__("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(a##J) : "m"(wp[J]), "v"(x));
  for (int64_t i = 0; i < rounds; ++i) {
    if (kind == 0) {
      KVB_24(KVB_DP)
    } else {
      KVB_24(KVB_FMA)
    }
  }
#define KVB_SINK(J) __asm__ volatile("" ::"v"(a##J));
  KVB_24(KVB_SINK)
  return 0;
#endif
}

}  // extern "C"
