// Attention of packed query rows over K/V read in place from a pool, through slot lists.
//
// The CPU kernel behind `kvblocks.engine.kernel`: short segments' keys are attended here straight
// from the pool's slots, instead of being gathered into a new tensor for every layer of every step;
// a shared run is read once for every row of the segments that start with it. Built at first use
// with the machine's C++ compiler and loaded with ctypes; it includes no torch headers.
//
// Exactness and batch invariance. A (segment, query head, row) is computed on its own: its
// scores, an exact softmax (max, exp, sum) and its weighted values, in an order fixed by the row's
// query, the keys it sees and their number. Nothing depends on the other rows of a call, on the
// batch, or on where the keys lie in the pool. A score's dot product is one chain of multiply-adds
// over the head dim in order; sums over keys run in fixed lanes added in a fixed tree; the only
// fused multiply-adds are the explicit ones of `fmadd` (the build passes -ffp-contract=off), so every
// path through the code rounds a row the same way.
// A masked key adds exact zeros. The output is normalised and each row's log-sum-exp returned, so results
// over disjoint key sets merge exactly.
//
// Vectors are GCC's generic vector extension (AVX-512, AVX2, NEON: whatever the target has).
//
// Storage and arithmetic. Pools and queries of float32 and float64 are computed in their own type;
// bfloat16 ones are stored in bfloat16 and computed in float32: every query, key and value element
// widened exactly (its 16 bits the top of a float's 32) as it is read, then the same float32 code
// as a float32 pool, so a row's bits still depend only on its own inputs. Outputs are rounded to
// bfloat16 (to nearest, ties to even), log-sum-exps written in float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

struct Layout {
  int64_t q_head, q_row;         // query strides (elements): head, packed row; the head dim is contiguous
  int64_t slot, value, kv_head;  // pool strides: slot, K -> V, K/V head; the head dim is contiguous
  int64_t heads, kv_heads, dim;  // outputs are [rows, heads, dim] and log-sum-exps [rows, heads], contiguous
};

// What a call attends. Group g's segments are member_offsets[g] .. member_offsets[g + 1] - 1; they
// all first see the keys shared[shared_offsets[g] .. shared_offsets[g + 1]) (pool slots, in position
// order), read once for all of them. Segment s has the packed query rows rows[row_offsets[s] ..
// row_offsets[s + 1]) (where its outputs go too) and its own keys slots[key_offsets[s] ..
// key_offsets[s + 1]) after the shared ones; its i-th row sees the first min(n, visible[s] + i) of
// those n own keys. How keys are split into shared and own never changes a row's arithmetic.
struct Plan {
  const int64_t *member_offsets, *shared_offsets, *shared;
  const int64_t *row_offsets, *rows, *key_offsets, *slots, *visible;
  int64_t groups;
};

// a bfloat16 element: the top 16 bits of a float32
struct bf16 {
  uint16_t bits;
};

// the type a storage type is computed in
template <typename S>
struct Compute {
  typedef S type;
};

template <>
struct Compute<bf16> {
  typedef float type;
};

template <typename T, int W>
struct Vec {
  typedef T type __attribute__((vector_size(W * sizeof(T))));
};

// a * b + c: one fused multiply-add where the target has one for this vector (AVX-512, FMA3, NEON),
// else a multiplication and an addition. Always the same for a given build: the build passes
// -ffp-contract=off, so the compiler never fuses anything on its own, differently in different places.
template <typename T, typename V>
inline V fmadd(V a, V b, V c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64 && std::is_same_v<T, float>)
    return reinterpret_cast<V>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
  if constexpr (sizeof(V) == 64 && std::is_same_v<T, double>)
    return reinterpret_cast<V>(_mm512_fmadd_pd(reinterpret_cast<__m512d>(a), reinterpret_cast<__m512d>(b),
                                               reinterpret_cast<__m512d>(c)));
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32 && std::is_same_v<T, float>)
    return reinterpret_cast<V>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
  if constexpr (sizeof(V) == 32 && std::is_same_v<T, double>)
    return reinterpret_cast<V>(_mm256_fmadd_pd(reinterpret_cast<__m256d>(a), reinterpret_cast<__m256d>(b),
                                               reinterpret_cast<__m256d>(c)));
  if constexpr (sizeof(V) == 16 && std::is_same_v<T, float>)
    return reinterpret_cast<V>(_mm_fmadd_ps(reinterpret_cast<__m128>(a), reinterpret_cast<__m128>(b),
                                            reinterpret_cast<__m128>(c)));
  if constexpr (sizeof(V) == 16 && std::is_same_v<T, double>)
    return reinterpret_cast<V>(_mm_fmadd_pd(reinterpret_cast<__m128d>(a), reinterpret_cast<__m128d>(b),
                                            reinterpret_cast<__m128d>(c)));
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
  if constexpr (sizeof(V) == 16 && std::is_same_v<T, float>)
    return reinterpret_cast<V>(vfmaq_f32(reinterpret_cast<float32x4_t>(c), reinterpret_cast<float32x4_t>(a),
                                         reinterpret_cast<float32x4_t>(b)));
  if constexpr (sizeof(V) == 16 && std::is_same_v<T, double>)
    return reinterpret_cast<V>(vfmaq_f64(reinterpret_cast<float64x2_t>(c), reinterpret_cast<float64x2_t>(a),
                                         reinterpret_cast<float64x2_t>(b)));
#endif
  return a * b + c;
}

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// a vector of the compute type from as many elements of storage type S at p (widened exactly)
template <typename V, typename S>
inline V load_as(const S* p) {
  if constexpr (std::is_same_v<S, bf16>) {
    constexpr int W = sizeof(V) / sizeof(float);
    typedef uint16_t H __attribute__((vector_size(W * sizeof(uint16_t))));
    typedef uint32_t U __attribute__((vector_size(W * sizeof(uint32_t))));
    const U bits = __builtin_convertvector(load<H>(p), U) << 16;
    V v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  } else {
    return load<V>(p);
  }
}

inline float widen(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 to bfloat16, to nearest with ties to even (a NaN stays a quiet NaN of its sign)
inline bf16 round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return bf16{static_cast<uint16_t>((bits >> 16) | 0x40)};
  bits += 0x7FFF + ((bits >> 16) & 1);
  return bf16{static_cast<uint16_t>(bits >> 16)};
}

// n elements of the compute type stored at p in storage type S
template <typename S, typename T>
inline void store_as(S* p, const T* x, int64_t n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(p, x, n * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) p[i] = round_bf16(x[i]);
  }
}

// x in every lane: x - (+0) is x for every x, -0 included, so this is a plain broadcast (`V{} + x`
// turns -0 into +0, which the compiler must then compute)
template <typename V, typename T>
inline V splat(T x) {
  return x - V{};
}

// Sum of a vector's lanes in a fixed tree: the halves added lane by lane, down to two lanes (the
// halves taken by shuffles: a copy through memory kept a loop's running sum on the stack)
template <typename V, int H, std::size_t... I>
inline auto half(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (H + I)...);
}

template <typename T, int W>
inline T lanes_sum(typename Vec<T, W>::type v) {
  if constexpr (W == 2) {
    return v[0] + v[1];
  } else {
    const auto lanes = std::make_index_sequence<W / 2>{};
    return lanes_sum<T, W / 2>(half<decltype(v), 0>(v, lanes) + half<decltype(v), W / 2>(v, lanes));
  }
}

// W vectors of W lanes transposed in registers (x[i][j] becomes x[j][i]): log2(W) stages, the
// stage of stride s swapping the off-diagonal s-by-s blocks of every 2s-by-2s block.
template <int W, int S, bool High>
constexpr int swap_index(int lane) {
  return High ? ((lane & S) ? W + lane : lane + S) : ((lane & S) ? W + lane - S : lane);
}

template <typename V, int W, int S, bool High, std::size_t... I>
inline V swap(V a, V b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, swap_index<W, S, High>(I)...);
}

template <typename V, int W, int S = 1>
inline void transpose(V* x) {
  if constexpr (S < W) {
    const auto lanes = std::make_index_sequence<W>{};
    for (int i = 0; i < W; ++i)
      if (!(i & S)) {
        const V a = x[i], b = x[i + S];
        x[i] = swap<V, W, S, false>(a, b, lanes);
        x[i + S] = swap<V, W, S, true>(a, b, lanes);
      }
    transpose<V, W, 2 * S>(x);
  }
}

// exp(x) for x <= 0 (or -inf) lane by lane: Cody-Waite reduction to |r| <= ln2 / 2, a Taylor
// polynomial (degree 7 in float, 12 in double: within about an ulp) by Horner's rule in explicit
// fused multiply-adds, and 2^k by the exponent bits. Every lane of every vector takes the same steps.
template <typename T>
struct Exp;

template <>
struct Exp<float> {
  typedef int32_t bits;
  static constexpr float low = -87.0f, log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
  static constexpr float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  static constexpr int bias = 127, mantissa = 23, degree = 7;
};

template <>
struct Exp<double> {
  typedef int64_t bits;
  static constexpr double low = -708.0, log2e = 1.4426950408889634074;
  static constexpr double ln2_hi = 0.6931471803691238164902, ln2_lo = 1.9082149292705877e-10;
  static constexpr double shifter = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr int bias = 1023, mantissa = 52, degree = 12;
};

template <typename T, int W>
inline typename Vec<T, W>::type exp_nonpositive(typename Vec<T, W>::type x) {
  typedef typename Vec<T, W>::type V;
  typedef typename Exp<T>::bits B;
  typedef B I __attribute__((vector_size(W * sizeof(B))));
  typedef Exp<T> E;
  const V low = V{} + E::low;
  V clamped = x < low ? low : x;
  V k = (clamped * E::log2e + E::shifter) - E::shifter;
  V r = clamped - k * E::ln2_hi;
  r = r - k * E::ln2_lo;
  T inverse[E::degree + 1];
  inverse[0] = 1;
  for (int i = 1; i <= E::degree; ++i) inverse[i] = inverse[i - 1] / i;
  V p = V{} + inverse[E::degree];
  for (int i = E::degree - 1; i >= 0; --i) p = fmadd<T>(p, r, splat<V>(inverse[i]));
  I exponent = (__builtin_convertvector(k, I) + E::bias) << E::mantissa;
  V scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return x < low ? V{} : p * scale;
}

// the target's vector registers and the bytes each holds: how many sums a score tile may keep
#if defined(__AVX512F__)
constexpr int registers = 32, register_bytes = 64;
#elif defined(__AVX__)
constexpr int registers = 16, register_bytes = 32;
#elif defined(__aarch64__)
constexpr int registers = 32, register_bytes = 16;
#else
constexpr int registers = 16, register_bytes = 16;
#endif

constexpr int64_t KB = 64;  // keys per span: its K rows transposed and its V rows stay in L1 for every row

// x, held in a register from here: GCC otherwise reads a tile's keys from memory again at every
// multiply-add that uses them (a load per multiply-add, as many as before the tiles). Only for a
// vector one register holds (a wider one is several registers to the compiler anyway).
template <typename V>
inline void in_register(V& x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) <= 64) asm("" : "+v"(x));
#elif defined(__AVX__)
  if constexpr (sizeof(V) <= 32) asm("" : "+x"(x));
#elif defined(__x86_64__) || defined(__i386__)
  if constexpr (sizeof(V) <= 16) asm("" : "+x"(x));
#elif defined(__aarch64__)
  if constexpr (sizeof(V) <= 16) asm("" : "+w"(x));
#endif
}

// A row of `dim` elements prefetched: into L1 (`Locality` 3), L2 (2, 1) or closest to the core
// without polluting the caches (0).
template <int Locality, typename T>
inline void prefetch(const T* p, int64_t dim) {
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) {
    const char* line = reinterpret_cast<const char*>(p) + b;
    __builtin_prefetch(line, 0, Locality);
    asm volatile("" : : "r"(line));  // GCC deletes a loop that only prefetches (no side effects, it says)
  }
}

// A query row of one K/V head: its query, where its scores and output go, what it sees.
template <typename T>
struct Row {
  const T* q;
  T* scores;     // its shared keys' scores, then its own keys'; padded with -inf to lanes
  T* acc;        // its weighted values (head dim)
  int64_t start;  // where its scores start in the call's buffer
  int64_t own;   // its segment's own keys: slots[own .. own + n) of the plan
  int64_t n, sees;  // own keys, and how many of them it sees
  int64_t out;   // its index into the outputs (packed row * heads + head)
  T top, total;
};

// The rows of a K/V head, each row's head dim `NV` vectors of `W` lanes: scores `SR` rows at a time,
// weighted values `RB` at a time. Queries and pools are stored in `S`, computed in `T`.
template <typename S, int W, int NV>
struct Kernel {
  typedef typename Compute<S>::type T;
  typedef typename Vec<T, W>::type V;
  static constexpr int RB = 16 / NV >= 4 ? 4 : 16 / NV >= 1 ? 16 / NV : 1;  // rows per weighing (registers)

  // Scores. A key's score for a row is scale * (its dot product with the row's query), the dot
  // product one chain of `fmadd`s over the head dim from 0, whichever tile computes it.
  // The keys are read `KB` at a time into `kt` transposed (kt[d * KB + j]: key j's element d), then
  // a tile of `SR` rows by `KT` vectors of keys keeps its SR * KT sums in registers and loads, per
  // head-dim element, KT vectors of keys and SR query elements: no sums across lanes, and each load
  // feeds several multiply-adds (the untransposed dot products loaded one key row per multiply-add
  // and summed lanes by a tree of shuffles: 1.4x the time of the weighted values, measured). KT:
  // SR * KT sums, KT keys and a query element in registers.
  static constexpr int SR = 4;
  static constexpr int KT = std::clamp<int64_t>(
      (registers / ((sizeof(V) + register_bytes - 1) / register_bytes) - SR) / (SR + 1), 1, KB / W);

  // `count` keys' K rows into `kt`, whole vectors (zeros past `count`)
  __attribute__((noinline)) static void gather(T* kt, const S* pool, const int64_t* keys, int64_t count, const Layout& at, int64_t h) {
    const int64_t offset = h * at.kv_head;
    for (int64_t j = 0; j < count; j += W) {
      for (int v = 0; v < NV; ++v) {
        V x[W];
        for (int l = 0; l < W; ++l) x[l] = j + l < count ? load_as<V>(pool + keys[j + l] * at.slot + offset + v * W) : V{};
        transpose<V, W>(x);
        for (int l = 0; l < W; ++l) std::memcpy(kt + (v * W + l) * KB + j, &x[l], sizeof(V));
      }
    }
  }

  // the scores of R rows over the K * W keys of `kt`, written from `first` on in each row
  template <int R, int K>
  __attribute__((noinline)) static void score_tile(Row<T>* rows, const T* kt, int64_t first, T scale) {
    const T* q[R];
    for (int r = 0; r < R; ++r) q[r] = rows[r].q;
    V acc[R][K] = {};
    for (int d = 0; d < NV * W; ++d) {
      V k[K];
      for (int c = 0; c < K; ++c) in_register(k[c] = load<V>(kt + d * KB + c * W));
      for (int r = 0; r < R; ++r) {
        const V x = splat<V>(q[r][d]);
        for (int c = 0; c < K; ++c) acc[r][c] = fmadd<T>(x, k[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < K; ++c) {
        const V y = acc[r][c] * scale;
        std::memcpy(rows[r].scores + first + c * W, &y, sizeof y);
      }
  }

  // the scores of rows[0 .. rb) (rb <= SR) over `count` keys of `kt`, whole vectors from `first` on
  // (past `count` they land where later keys' scores or the row's padding go)
  template <int R = 1>
  static void score_rows(Row<T>* rows, int rb, const T* kt, int64_t count, int64_t first, T scale) {
    if constexpr (R < SR) {
      if (rb > R) return score_rows<R + 1>(rows, rb, kt, count, first, scale);
    }
    int64_t j = 0;
    for (; j + KT * W <= count; j += KT * W) score_tile<R, KT>(rows, kt + j, first + j, scale);
    if (j < count) score_tail<R>(static_cast<int>((count - j + W - 1) / W), rows, kt + j, first + j, scale);
  }

  template <int R, int K = 1>
  static void score_tail(int vectors, Row<T>* rows, const T* kt, int64_t first, T scale) {
    if constexpr (K < KT) {
      if (vectors > K) return score_tail<R, K + 1>(vectors, rows, kt, first, scale);
    }
    score_tile<R, K>(rows, kt, first, scale);
  }

  // Keys whose scores are computed together: read into `kt` once, for rows [row, end), their scores
  // written from `first` on in each row.
  struct Span {
    const int64_t* keys;
    int64_t count, first, row, end;
  };

  // The spans of a K/V head's rows: its shared keys a block at a time for all rows, then each
  // segment's own keys a block at a time for its rows (those of one segment are adjacent and share
  // `own`), in key order for every row.
  static void spans_of(std::vector<Span>& spans, const std::vector<Row<T>>& rows, const int64_t* shared, int64_t m,
                       const Plan& plan) {
    const int64_t R = rows.size();
    spans.clear();
    for (int64_t b = 0; b < m; b += KB) spans.push_back(Span{shared + b, std::min(KB, m - b), b, 0, R});
    for (int64_t r = 0, e = 0; r < R; r = e) {
      while (e < R && rows[e].own == rows[r].own) ++e;
      for (int64_t b = 0; b < rows[r].n; b += KB)
        spans.push_back(Span{plan.slots + rows[r].own + b, std::min(KB, rows[r].n - b), m + b, r, e});
    }
  }

  // `begin(span)`, then `tile(span, t, row, rb)` for each tile of `Per` rows, for each span in
  // order. Before tile t of a span, `fetch(keys, count)` is given the t-th share of the next span's
  // keys: a pass prefetches the next span while it computes this one (a step's KV does not fit in
  // cache: its rows come from memory), a share per tile so the prefetches do not wait on each other.
  template <int Per, typename B, typename F, typename P>
  static void walk(const std::vector<Span>& spans, B begin, F tile, P fetch) {
    for (size_t i = 0; i < spans.size(); ++i) {
      const Span& s = spans[i];
      begin(s);
      const int64_t tiles = (s.end - s.row + Per - 1) / Per;
      for (int64_t t = 0; t < tiles; ++t) {
        if (i + 1 < spans.size()) {
          const Span& next = spans[i + 1];
          const int64_t from = next.count * t / tiles;
          fetch(next.keys + from, next.count * (t + 1) / tiles - from);
        }
        const int64_t r = s.row + t * Per;
        tile(s, t, r, static_cast<int>(std::min<int64_t>(Per, s.end - r)));
      }
    }
  }

  // the weighted values of rows[0 .. rb) over `count` keys from `keys`, their scores from `first` on;
  // every accumulator is indexed by a constant (a fold over `I`), so it lives in a register. This and
  // `score_tile` stay out of line: inlined into `walk`'s callbacks, weighing ran 1.4x slower and a
  // score tile spilled its keys to the stack (measured).
  static void weigh(Row<T>* rows, int rb, const S* pool, const int64_t* keys, int64_t count, int64_t first,
                    const Layout& at, int64_t h) {
    weigh(rows, rb, pool, keys, count, first, at, h, std::make_index_sequence<RB * NV>{});
  }

  template <std::size_t... I>
  __attribute__((noinline)) static void weigh(Row<T>* rows, int rb, const S* pool, const int64_t* keys, int64_t count, int64_t first,
                    const Layout& at, int64_t h, std::index_sequence<I...>) {
    const T* weights[RB];
    for (int r = 0; r < RB; ++r) weights[r] = rows[std::min(r, rb - 1)].scores + first;
    V acc[RB * NV] = {load<V>(rows[std::min<int>(I / NV, rb - 1)].acc + (I % NV) * W)...};
    const int64_t offset = at.value + h * at.kv_head;
    for (int64_t j = 0; j < count; ++j) {
      const S* value = pool + keys[j] * at.slot + offset;
      V vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load_as<V>(value + v * W);
      T w[RB];
      for (int r = 0; r < RB; ++r) w[r] = weights[r][j];
      ((acc[I] = fmadd<T>(splat<V>(w[I / NV]), vv[I % NV], acc[I])), ...);
    }
    (store(rows, rb, static_cast<int>(I / NV), static_cast<int>(I % NV), acc[I]), ...);
  }

  static void store(Row<T>* rows, int rb, int r, int v, V x) {
    if (r < rb) std::memcpy(rows[r].acc + v * W, &x, sizeof x);
  }

  // the largest of scores[0 .. n), n >= 1: lane by lane, then across lanes (a maximum is the same in
  // any order; -0 and +0, which may come out either way, give the same exp and log-sum-exp)
  static T max_of(const T* scores, int64_t n) {
    int64_t j = 0;
    T top = scores[0];
    if (n >= W) {
      V m = load<V>(scores);
      for (j = W; j + W <= n; j += W) {
        const V x = load<V>(scores + j);
        m = x > m ? x : m;
      }
      for (int l = 0; l < W; ++l) top = std::max(top, m[l]);
    }
    for (; j < n; ++j) top = std::max(top, scores[j]);
    return top;
  }

  static void run(const S* q, const S* pool, const Plan& plan, const Layout& at, T scale, S* out, T* lse) {
    const int64_t groups = at.heads / at.kv_heads, dim = at.dim;
    std::vector<T> scores, accs, kt(KB * dim), widened;
    std::vector<const S*> queries;
    std::vector<Row<T>> rows;
    std::vector<Span> spans;
    for (int64_t g = 0; g < plan.groups; ++g) {
      const int64_t* shared = plan.shared + plan.shared_offsets[g];
      const int64_t m = plan.shared_offsets[g + 1] - plan.shared_offsets[g];
      for (int64_t h = 0; h < at.kv_heads; ++h) {
        // the group's rows of this K/V head, segment by segment: query head h * groups + c, row i
        rows.clear();
        queries.clear();
        int64_t space = 0;
        for (int64_t s = plan.member_offsets[g]; s < plan.member_offsets[g + 1]; ++s) {
          const int64_t n = plan.key_offsets[s + 1] - plan.key_offsets[s];
          const int64_t width = plan.row_offsets[s + 1] - plan.row_offsets[s];
          for (int64_t c = 0; c < groups; ++c)
            for (int64_t i = 0; i < width; ++i) {
              const int64_t row = plan.rows[plan.row_offsets[s] + i], head = h * groups + c;
              queries.push_back(q + head * at.q_head + row * at.q_row);
              rows.push_back(Row<T>{nullptr, nullptr, nullptr, space,
                                    plan.key_offsets[s], n, std::min(n, plan.visible[s] + i),
                                    row * at.heads + head, 0, 0});
              space += (m + n + W - 1) / W * W + W;  // + W: an own tile's last vector may pass m + n
            }
        }
        if (rows.empty()) continue;
        if (static_cast<int64_t>(scores.size()) < space) scores.resize(space);
        if (accs.size() < rows.size() * dim) accs.resize(rows.size() * dim);
        if constexpr (!std::is_same_v<S, T>) {
          if (widened.size() < rows.size() * dim) widened.resize(rows.size() * dim);
        }
        for (size_t r = 0; r < rows.size(); ++r) {
          rows[r].scores = scores.data() + rows[r].start;
          rows[r].acc = accs.data() + r * dim;
          if constexpr (std::is_same_v<S, T>) {
            rows[r].q = queries[r];
          } else {
            for (int64_t d = 0; d < dim; ++d) widened[r * dim + d] = widen(queries[r][d]);
            rows[r].q = widened.data() + r * dim;
          }
        }
        const int64_t R = rows.size();
        spans_of(spans, rows, shared, m, plan);
        const int64_t k_offset = h * at.kv_head, v_offset = k_offset + at.value;
        walk<SR>(spans, [&](const Span& s) { gather(kt.data(), pool, s.keys, s.count, at, h); },
                 [&](const Span& s, int64_t, int64_t r, int rb) {
          score_rows(&rows[r], rb, kt.data(), s.count, s.first, scale);
        }, [&](const int64_t* keys, int64_t count) {
          for (int64_t l = 0; l < count; ++l) {
            prefetch<2>(pool + keys[l] * at.slot + k_offset, at.dim);
          }
        });
        // softmax: each row's largest visible score, exp of the differences, their sum
        for (Row<T>& x : rows) {
          const int64_t seen = m + x.sees, padded = (m + x.n + W - 1) / W * W;
          for (int64_t j = seen; j < padded; ++j) x.scores[j] = -std::numeric_limits<T>::infinity();
          T top = max_of(x.scores, seen);
          T* const scores = x.scores;  // a local: the stores below could alias `x` for the compiler
          V sum{};
          for (int64_t j = 0; j < padded; j += W) {
            V e = exp_nonpositive<T, W>(load<V>(scores + j) - top);
            std::memcpy(scores + j, &e, sizeof e);
            sum = sum + e;
          }
          x.top = top;
          x.total = lanes_sum<T, W>(sum);
        }
        // the weighted values in key order: shared keys a block at a time, then each segment's own
        std::fill(accs.begin(), accs.begin() + R * dim, T(0));
        walk<RB>(spans, [](const Span&) {}, [&](const Span& s, int64_t t, int64_t r, int rb) {
          weigh(&rows[r], rb, pool, s.keys, s.count, s.first, at, h);
        }, [&](const int64_t* keys, int64_t count) {
          for (int64_t l = 0; l < count; ++l) {
            prefetch<2>(pool + keys[l] * at.slot + v_offset, at.dim);
            if (h + 1 < at.kv_heads) prefetch<1>(pool + keys[l] * at.slot + k_offset + at.kv_head, at.dim);
          }
        });
        for (const Row<T>& x : rows) {
          S* o = out + x.out * dim;
          for (int64_t v = 0; v < NV; ++v) {
            const V y = load<V>(x.acc + v * W) / x.total;
            T lanes[W];
            std::memcpy(lanes, &y, sizeof y);
            store_as(o + v * W, lanes, W);
          }
          if (lse) lse[x.out] = x.top + std::log(x.total);
        }
      }
    }
  }
};

template <typename S, int W, typename T = typename Compute<S>::type>
bool dispatch(int64_t nv, const S* q, const S* pool, const Plan& plan, const Layout& at, T scale, S* out,
              T* lse) {
#define KVB_CASE(N)                                                                               \
  case N:                                                                                         \
    Kernel<S, W, N>::run(q, pool, plan, at, scale, out, lse);                                    \
    return true;
  switch (nv) {
    KVB_CASE(1)
    KVB_CASE(2)
    KVB_CASE(3)
    KVB_CASE(4)
    KVB_CASE(5)
    KVB_CASE(6)
    KVB_CASE(8)
    KVB_CASE(16)
  }
#undef KVB_CASE
  return false;
}

template <typename S, typename T = typename Compute<S>::type>
int attend(const S* q, const S* pool, const int64_t* const* index, int64_t groups, const int64_t* layout,
           double scale, S* out, T* lse) {
  const Plan plan{index[0], index[1], index[2], index[3], index[4], index[5], index[6], index[7], groups};
  const Layout at{layout[0], layout[1], layout[2], layout[3], layout[4], layout[5], layout[6], layout[7]};
  if (at.kv_heads <= 0 || at.heads % at.kv_heads || at.dim <= 0) return 1;
  // A vector is one register of the target where the head dim allows (64 bytes with AVX-512, 32 with
  // AVX2): 64-byte vectors on AVX2 were two registers each to GCC, their multiply-adds unfused (a
  // 0.5B model's decode step of 16 rows took 1.9x as long); then 64 bytes (a head dim of more vectors
  // than the kernels are built for), then 16.
  constexpr int reg = std::max<int>(register_bytes, 16) / sizeof(T), wide = 64 / sizeof(T),
                narrow = 16 / sizeof(T);
  const T s = static_cast<T>(scale);
  if (at.dim % reg == 0 && dispatch<S, reg>(at.dim / reg, q, pool, plan, at, s, out, lse)) return 0;
  if (wide != reg && at.dim % wide == 0 && dispatch<S, wide>(at.dim / wide, q, pool, plan, at, s, out, lse))
    return 0;
  if (at.dim % narrow == 0 && dispatch<S, narrow>(at.dim / narrow, q, pool, plan, at, s, out, lse)) return 0;
  return 2;  // a head dim this build has no kernel for
}

}  // namespace

// index: the eight arrays of a Plan, in its order; layout: the eight Layout fields; lse may be null.
// Returns 0, or 1 for a bad layout, 2 for a head dim without a kernel (nothing written then).
extern "C" {

int kvb_attend_f32(const float* q, const float* pool, const int64_t* const* index, int64_t groups,
                   const int64_t* layout, double scale, float* out, float* lse) {
  return attend<float>(q, pool, index, groups, layout, scale, out, lse);
}

int kvb_attend_f64(const double* q, const double* pool, const int64_t* const* index, int64_t groups,
                   const int64_t* layout, double scale, double* out, double* lse) {
  return attend<double>(q, pool, index, groups, layout, scale, out, lse);
}

// bfloat16 queries, pool and outputs (their bits), float32 log-sum-exps
int kvb_attend_bf16(const uint16_t* q, const uint16_t* pool, const int64_t* const* index, int64_t groups,
                    const int64_t* layout, double scale, uint16_t* out, float* lse) {
  return attend<bf16>(reinterpret_cast<const bf16*>(q), reinterpret_cast<const bf16*>(pool), index, groups,
                      layout, scale, reinterpret_cast<bf16*>(out), lse);
}

}  // extern "C"
