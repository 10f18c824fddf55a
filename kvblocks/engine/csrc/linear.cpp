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
//
// Without AVX512-BF16, on a CPU with AVX2 and FMA (AMD Zen 2/3, Intel Haswell to Alder Lake), the
// same layout and the same sums: 8 columns of a block are the lanes of a vector, their weight pairs
// widened to float32 once per pair step (the 16 bits shifted up: exact), each row of the tile an
// accumulator of its own (its inputs broadcast), adding the pair's odd product then its even one
// with a fused multiply-add, as `vdpbf16ps` does (the product of two bfloat16 values is exact in
// float32, so each step rounds once, in the same order; only denormals differ: `vdpbf16ps` flushes
// them). Only a tile's real rows are computed, each by the same instructions at any row count.
// Rounding to bfloat16 is to nearest, ties to even, in integer arithmetic. Two 8-lane multiply-adds
// per weight at 16 rows where AVX512-BF16 needs half of one 16-lane instruction.
//
// Float32 weights (`kvb_linear_f32`, built wherever AVX2 and FMA are): the same blocks of kCols
// columns, one weight per input column instead of a pair ([n / kCols][k][kCols] float32). An output
// (row, column) is one chain of fused multiply-adds over the k inputs in order (each step rounds once),
// then the bias added: in 8-lane vectors of columns, each row's sums in registers of its own (its
// input broadcast), up to 4 rows by 24 columns at a time (12 accumulators, 3 weight vectors and a
// broadcast in the 16 registers). A row's result depends only on its own inputs and the weights, as
// above; the weights are read once per call, a chunk of them in L1 while every row tile uses it.

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVB_HAVE_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVB_HAVE_AVX2 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVB_HAVE_F32 1
#endif

namespace {

constexpr int64_t kCols = 24;  // accumulators: one per output column of a block (of 32 registers)
constexpr int64_t kRows = 16;  // rows per tile: the lanes of a float32 vector
// Input pairs of a block run over all row tiles before the next ones (24 KB of weights, in the first
// level cache while the tiles re-read them); a lane's sum still adds its pairs in order of p.
#ifdef KVB_HAVE_AVX2
constexpr int64_t kChunk = 64;  // AVX2: the chunk's weights (6 KB) and widened inputs (8 KB) in L1
#else
constexpr int64_t kChunk = 256;
#endif
constexpr int64_t kAhead = 4096;  // int32 elements (16 KB) of the weight stream prefetched ahead
constexpr int64_t kVecF = 8;  // float32 lanes of an AVX2 vector

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


#ifdef KVB_HAVE_AVX2
constexpr int64_t kVec = 8;  // columns of a vector (8 float32 lanes)

// Rows r0 .. r0 + R - 1 of a tile by the 8 columns c0 .. c0 + 7 of a block over the pairs p0 .. p1 - 1:
// one accumulator per row (its 8 columns in the lanes), each step widening the 8 columns' weight
// pairs once (`w0` the even weights, `w1` the odd ones) and broadcasting each row's two inputs.
// `st` the rows' sums, row-major [16][kCols].
template <int R>
inline void rows2(const float* xf, const int32_t* w, int64_t p0, int64_t p1, int64_t r0, int64_t c0,
                  float* st, bool first) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 a[R];
  for (int i = 0; i < R; ++i) a[i] = first ? _mm256_setzero_ps() : _mm256_load_ps(st + (r0 + i) * kCols + c0);
  for (int64_t p = p0; p < p1; ++p) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kCols + c0));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
    const float* xp = xf + p * 2 * kRows + r0;
    for (int i = 0; i < R; ++i) {
      a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xp + kRows + i), w1, a[i]);
      a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xp + i), w0, a[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_store_ps(st + (r0 + i) * kCols + c0, a[i]);
}

// `rows2<count>` (1 <= count <= 12): each row runs the same instructions whatever the count.
inline void rows_of(int64_t count, const float* xf, const int32_t* w, int64_t p0, int64_t p1, int64_t r0,
                    int64_t c0, float* st, bool first) {
  switch (count) {
#define KVB_ROWS(R) \
  case R:           \
    return rows2<R>(xf, w, p0, p1, r0, c0, st, first);
    KVB_ROWS(1) KVB_ROWS(2) KVB_ROWS(3) KVB_ROWS(4) KVB_ROWS(5) KVB_ROWS(6)
    KVB_ROWS(7) KVB_ROWS(8) KVB_ROWS(9) KVB_ROWS(10) KVB_ROWS(11) KVB_ROWS(12)
    default:
      return;
  }
}

// The AVX2 tile: as `tile`, with `xf` the tile's inputs widened, [k / 2][2][16] float32 (each pair's
// even inputs of the 16 rows, then its odd ones), and `state` row-major ([16][kCols]); the block's
// columns 8 at a time, the tile's `rows` real rows (1 to 16) 12 at a time (a row's accumulator its
// own register, so a row is computed alike with any other rows, and padding rows are not computed).
inline void tile2(const float* xf, const int32_t* w, int64_t p0, int64_t p1, float* state, bool first,
                  bool last, bool fetch, const float* bias, uint16_t* out, int64_t rows) {
  if (fetch)  // the next chunk's weights (the block's next pairs, or the next block's first) into L2
    for (int64_t i = 0; i < (p1 - p0) * kCols; i += 16) _mm_prefetch((const char*)(w + p1 * kCols + i), _MM_HINT_T1);
  for (int64_t c0 = 0; c0 < kCols; c0 += kVec)
    for (int64_t r0 = 0; r0 < rows; r0 += 12)
      rows_of(rows - r0 < 12 ? rows - r0 : 12, xf, w, p0, p1, r0, c0, state, first);
  if (!last) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < kCols; c0 += kVec) {
      const __m256 sum = _mm256_add_ps(_mm256_load_ps(state + r * kCols + c0), _mm256_loadu_ps(bias + c0));
      const __m256i v = _mm256_castps_si256(sum);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(1));
      __m256i b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7FFFFFFF)),
                                             _mm256_set1_epi32(0x7F800000));
      b = _mm256_blendv_epi8(b, _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(0x40)), nan);
      alignas(32) uint32_t bits[kVec];  // to nearest, ties to even; a NaN stays a (quiet) NaN
      _mm256_store_si256(reinterpret_cast<__m256i*>(bits), b);
      for (int64_t j = 0; j < kVec; ++j) out[(c0 + j) * kRows + r] = uint16_t(bits[j]);
    }
}
#endif

#ifdef KVB_HAVE_F32
constexpr int64_t kChunkF = 64;  // float32: a chunk's weights (6 KB) and a tile's inputs (4 KB) in L1
#ifndef KVB_F32_AHEAD
#define KVB_F32_AHEAD 4096
#endif
#ifndef KVB_F32_HINT
#define KVB_F32_HINT _MM_HINT_T0
#endif
constexpr int64_t kAheadF = KVB_F32_AHEAD;  // float32 elements (16 KB) of the weight stream prefetched ahead

// Rows r0 .. r0 + R - 1 (R <= 4) of a tile by the 24 columns of a float32 block over the inputs
// p0 .. p1 - 1: `xt` the tile's inputs lane-major ([k][16]), `w` the block ([k][kCols]), `st` the rows'
// sums, row-major [16][kCols] (zero first, or where the previous inputs left them). The accumulators
// are named one by one (GCC keeps an array of vectors in memory, storing it every step).
#define KVB_F32_ROW(I)                                                                        \
  __m256 a##I##0 = _mm256_setzero_ps(), a##I##1 = a##I##0, a##I##2 = a##I##0;               \
  if (R > I && !first) {                                                                    \
    a##I##0 = _mm256_load_ps(st + (r0 + I) * kCols);                                        \
    a##I##1 = _mm256_load_ps(st + (r0 + I) * kCols + kVecF);                                \
    a##I##2 = _mm256_load_ps(st + (r0 + I) * kCols + 2 * kVecF);                            \
  }
#define KVB_F32_FMA(I)                                   \
  if constexpr (R > I) {                                 \
    const __m256 x = _mm256_broadcast_ss(xp + I);        \
    a##I##0 = _mm256_fmadd_ps(x, w0, a##I##0);           \
    a##I##1 = _mm256_fmadd_ps(x, w1, a##I##1);           \
    a##I##2 = _mm256_fmadd_ps(x, w2, a##I##2);           \
  }
#define KVB_F32_SAVE(I)                                           \
  if constexpr (R > I) {                                          \
    _mm256_store_ps(st + (r0 + I) * kCols, a##I##0);              \
    _mm256_store_ps(st + (r0 + I) * kCols + kVecF, a##I##1);      \
    _mm256_store_ps(st + (r0 + I) * kCols + 2 * kVecF, a##I##2);  \
  }
template <int R, bool Fetch>
inline void rows_f32(const float* xt, const float* w, int64_t p0, int64_t p1, int64_t r0, float* st,
                     bool first) {
  static_assert(R >= 1 && R <= 4 && kCols == 3 * kVecF, "4 rows by three vectors of columns at most");
  KVB_F32_ROW(0) KVB_F32_ROW(1) KVB_F32_ROW(2) KVB_F32_ROW(3)
  for (int64_t p = p0; p < p1; ++p) {
    const float* wp = w + p * kCols;
    if constexpr (Fetch) {  // the weights kAheadF ahead, a line and a half per step, as they stream
      _mm_prefetch((const char*)(wp + kAheadF), KVB_F32_HINT);
      _mm_prefetch((const char*)(wp + kAheadF + 16), KVB_F32_HINT);
    }
    __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + kVecF), w2 = _mm256_loadu_ps(wp + 2 * kVecF);
    __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2));  // in registers: loaded once, not once per row
    const float* xp = xt + p * kRows + r0;
    KVB_F32_FMA(0) KVB_F32_FMA(1) KVB_F32_FMA(2) KVB_F32_FMA(3)
  }
  KVB_F32_SAVE(0) KVB_F32_SAVE(1) KVB_F32_SAVE(2) KVB_F32_SAVE(3)
}

// A float32 tile's `rows` real rows (1 to 16) over one chunk: 4 rows by the block's 24 columns at a
// time, the last 1 to 3 rows alike (the same instructions for a row whatever its neighbours); the
// first rows of the first tile (`fetch`) prefetch the weights ahead.
template <int R>
inline void rows_f32_of(const float* xt, const float* w, int64_t p0, int64_t p1, int64_t r0, float* st,
                        bool first, bool fetch) {
  if (fetch)
    rows_f32<R, true>(xt, w, p0, p1, r0, st, first);
  else
    rows_f32<R, false>(xt, w, p0, p1, r0, st, first);
}

inline void tile_f32(const float* xt, const float* w, int64_t p0, int64_t p1, float* st, bool first,
                     bool fetch, int64_t rows) {
  int64_t r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) rows_f32_of<4>(xt, w, p0, p1, r0, st, first, fetch && r0 == 0);
  switch (rows - r0) {
    case 3:
      return rows_f32_of<3>(xt, w, p0, p1, r0, st, first, fetch && r0 == 0);
    case 2:
      return rows_f32_of<2>(xt, w, p0, p1, r0, st, first, fetch && r0 == 0);
    case 1:
      return rows_f32_of<1>(xt, w, p0, p1, r0, st, first, fetch && r0 == 0);
    default:
      return;
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

#if defined(KVB_HAVE_BF16) || defined(KVB_HAVE_AVX2)
// Every tile's inputs, lane-major, in `xt` (tiles * pairs * kXt 32-bit elements): with AVX512-BF16
// xt[t][p][r] = the pair (x[16 t + r][2p], x[16 t + r][2p + 1]); with AVX2 the pair widened to two
// float32, xt[t][p][0][r] = x[16 t + r][2p] and xt[t][p][1][r] = x[16 t + r][2p + 1]. Rows past m: 0.
#ifdef KVB_HAVE_BF16
constexpr int64_t kXt = kRows;
#else
constexpr int64_t kXt = 2 * kRows;
#endif
void lanes(const uint16_t* x, int64_t m, int64_t pairs, int64_t x_stride, int64_t tiles, int32_t* xt) {
  std::memset(xt, 0, sizeof(int32_t) * tiles * pairs * kXt);
  for (int64_t row = 0; row < m; ++row) {
    const uint16_t* src = x + row * x_stride;
    int32_t* dst = xt + row / kRows * pairs * kXt + row % kRows;
    for (int64_t p = 0; p < pairs; ++p) {
#ifdef KVB_HAVE_BF16
      std::memcpy(dst + p * kXt, src + 2 * p, 4);
#else
      dst[p * kXt] = int32_t(uint32_t(src[2 * p]) << 16);
      dst[p * kXt + kRows] = int32_t(uint32_t(src[2 * p + 1]) << 16);
#endif
    }
  }
}
#endif

// y[m, n] = x[m, k] @ w.T + bias (bias may be null), all bfloat16, float32 sums; x rows `x_stride`
// apart (k contiguous), y rows `y_stride` apart. Returns 0; 1 where k is odd; 2 where this build
// has neither AVX512-BF16 nor AVX2 and FMA; 3 where its buffers (the inputs once more, in float32
// sums of 16 x 24) cannot be allocated.
int kvb_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                    int64_t n, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
  if (k % 2) return 1;
#if !defined(KVB_HAVE_BF16) && !defined(KVB_HAVE_AVX2)
  (void)x, (void)m, (void)x_stride, (void)packed, (void)n, (void)bias, (void)y, (void)y_stride;
  return 2;
#else
  const int64_t pairs = k / 2, blocks = (n + kCols - 1) / kCols;
  const int64_t tiles = (m + kRows - 1) / kRows;
  int32_t* xt = static_cast<int32_t*>(_mm_malloc(sizeof(int32_t) * tiles * pairs * kXt, 64));
  if (xt == nullptr) return 3;
  lanes(x, m, pairs, x_stride, tiles, xt);
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
    const int64_t rows = m - t * kRows < kRows ? m - t * kRows : kRows;
    if (p1 == pairs)  // the block's biases, for the sums' last pairs
      for (int64_t j = 0; j < kCols; ++j) biases[j] = bias != nullptr && j < cols ? widen(bias[c0 + j]) : 0.0f;
#ifdef KVB_HAVE_BF16
    tile(xt + t * pairs * kXt, w + b * pairs * kCols, p0, p1, st, p0 == 0, p1 == pairs, fetch, biases, block);
#else
    tile2(reinterpret_cast<const float*>(xt + t * pairs * kXt), w + b * pairs * kCols, p0, p1, st, p0 == 0,
          p1 == pairs, fetch, biases, block, rows);
#endif
    if (p1 < pairs) return;
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

// Pack `w` ([n, k] float32, rows `w_stride` apart) into `out` (kvb_linear_packed_size elements).
void kvb_linear_pack_f32(const float* w, int64_t n, int64_t k, int64_t w_stride, float* out) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < kCols; ++j) {
        const int64_t c = b * kCols + j;
        out[(b * k + p) * kCols + j] = c < n ? w[c * w_stride + p] : 0.0f;
      }
}

// y[m, n] = x[m, k] @ w.T + bias (bias may be null), all float32; x rows `x_stride` apart (k
// contiguous), y rows `y_stride` apart. Returns 0; 2 where this build has no AVX2 and FMA; 3 where
// its buffers (the inputs once more, and float32 sums of 16 x 24 per row tile) cannot be allocated.
int kvb_linear_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
                   const float* bias, float* y, int64_t y_stride) {
#ifndef KVB_HAVE_F32
  (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)y, (void)y_stride;
  return 2;
#else
  const int64_t blocks = (n + kCols - 1) / kCols, tiles = (m + kRows - 1) / kRows;
  float* xt = static_cast<float*>(_mm_malloc(sizeof(float) * tiles * k * kRows, 64));
  float* state = static_cast<float*>(_mm_malloc(sizeof(float) * tiles * kCols * kRows, 64));
  if (xt == nullptr || state == nullptr) {
    _mm_free(xt);
    _mm_free(state);
    return 3;
  }
  std::memset(xt, 0, sizeof(float) * tiles * k * kRows);
  std::memset(state, 0, sizeof(float) * tiles * kCols * kRows);  // k = 0: the sums are the biases
  for (int64_t row = 0; row < m; ++row)  // xt[t][p][r] = x[16 t + r][p]
    for (int64_t p = 0; p < k; ++p) xt[(row / kRows * k + p) * kRows + row % kRows] = x[row * x_stride + p];
  // Block after block, each over its inputs chunk by chunk, every row tile over a chunk while the
  // chunk's weights are in the first level cache: each block's weights read from memory once.
  for (int64_t b = 0; b < blocks; ++b) {
    const float* w = packed + b * k * kCols;
    const int64_t c0 = b * kCols, cols = n - c0 < kCols ? n - c0 : kCols;
    for (int64_t p0 = 0; p0 < k; p0 += kChunkF) {
      const int64_t p1 = k - p0 < kChunkF ? k : p0 + kChunkF;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = m - t * kRows < kRows ? m - t * kRows : kRows;
        tile_f32(xt + t * k * kRows, w, p0, p1, state + t * kCols * kRows, p0 == 0, t == 0, rows);
      }
    }
    for (int64_t row = 0; row < m; ++row) {  // the sums, the bias added (one rounding), out
      const float* sum = state + row * kCols;  // tile row / 16, its row row % 16
      float* out = y + row * y_stride + c0;
      for (int64_t j = 0; j < cols; ++j) out[j] = bias == nullptr ? sum[j] : sum[j] + bias[c0 + j];
    }
  }
  _mm_free(state);
  _mm_free(xt);
  return 0;
#endif
}

// Multiply-adds of one weight and one row (lanes x weights per lane) one instruction of the product
// does: 32 for `vdpbf16ps` on zmm (16 lanes, a pair each), 16 for `vfmadd231ps` on zmm, 8 on ymm
// (the AVX2 build, both dtypes); 0 where this build has neither.
int kvb_linear_macs(int kind) {
#if defined(KVB_HAVE_BF16)
  return kind == 0 ? 32 : 16;
#elif defined(KVB_HAVE_AVX2)
  (void)kind;
  return 8;
#else
  (void)kind;
  return 0;
#endif
}

// The core's rate of the kernel's instruction: `rounds` x 24 independent `vdpbf16ps` (kind 0) or
// `vfmadd231ps` (kind 1, the float32 product's) on zmm registers, each with a broadcast memory
// operand as the kernel's, and nothing else; in the AVX2 build `rounds` x 12 independent
// `vfmadd231ps` on ymm registers (both kinds). What a product of 16 rows can reach at most:
// `kvb_linear_macs` / 16 weights per instruction. Returns 0, or 2 where this build has neither.
int kvb_linear_peak(int64_t rounds, int kind) {
#if defined(KVB_HAVE_BF16)
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
#elif defined(KVB_HAVE_AVX2)
  (void)kind;
  __m256 a[12];
  for (auto& r : a) r = _mm256_setzero_ps();
  __m256 x = _mm256_setzero_ps();
  __asm__ volatile("" : "+x"(x));
  for (int64_t i = 0; i < rounds; ++i)
    for (auto& r : a) r = _mm256_fmadd_ps(x, x, r);
  for (auto& r : a) __asm__ volatile("" ::"x"(r));
  return 0;
#else
  (void)rounds, (void)kind;
  return 2;
#endif
}

}  // extern "C"
