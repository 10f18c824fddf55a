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
// batch, or on where the keys lie in the pool. Sums over the head dimension and over keys run in
// fixed lanes added in a fixed tree; the only fused multiply-adds are the explicit ones of `fmadd`
// (the build passes -ffp-contract=off), so every path through the code rounds a row the same way.
// A masked key adds exact zeros. The output is normalised and each row's log-sum-exp returned, so results
// over disjoint key sets merge exactly.
//
// Vectors are GCC's generic vector extension (AVX-512, AVX2, NEON: whatever the target has).

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

// x in every lane: x - (+0) is x for every x, -0 included, so this is a plain broadcast (`V{} + x`
// turns -0 into +0, which the compiler must then compute)
template <typename V, typename T>
inline V splat(T x) {
  return x - V{};
}

// Sum of a vector's lanes in a fixed tree: the halves added lane by lane, down to two lanes.
template <typename T, int W>
inline T lanes_sum(typename Vec<T, W>::type v) {
  if constexpr (W == 2) {
    return v[0] + v[1];
  } else {
    typedef typename Vec<T, W / 2>::type H;
    H low, high;
    std::memcpy(&low, &v, sizeof low);
    std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
    return lanes_sum<T, W / 2>(low + high);
  }
}

// The lane sums of W vectors at once, as one vector (lane d: the sum of vector d's lanes), by the same
// tree as `lanes_sum` (halves added pairwise): at each level two vectors, each holding W / K sums of
// K partials, become one holding twice as many sums of K / 2 partials.
template <int W, int K, bool High>
constexpr int pick_index(int i) {
  const int half = K / 2, sum = i / half, j = i % half, per = W / K;
  return (sum < per ? sum * K : W + (sum - per) * K) + j + (High ? half : 0);
}

template <typename V, int W, int K, bool High, std::size_t... I>
inline V pick(V a, V b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, pick_index<W, K, High>(I)...);
}

template <typename T, int W, int K = W>
inline typename Vec<T, W>::type sums_of(typename Vec<T, W>::type* x) {
  typedef typename Vec<T, W>::type V;
  if constexpr (K == 1) {
    return x[0];
  } else {
    const auto lanes = std::make_index_sequence<W>{};
    for (int p = 0; p < K / 2; ++p)  // K vectors at this level, each holding W / K sums of K partials
      x[p] = pick<V, W, K, false>(x[2 * p], x[2 * p + 1], lanes) + pick<V, W, K, true>(x[2 * p], x[2 * p + 1], lanes);
    return sums_of<T, W, K / 2>(x);
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

constexpr int64_t ahead = 8;  // keys ahead whose K (V) rows are prefetched: slots lie anywhere in the pool
constexpr int64_t KB = 64;    // shared keys per block: a block's K (V) rows stay in L1 for every row

// A row of `dim` elements prefetched: into L1 for this pass (`Locality` 3), or, for a later pass's
// rows of the same keys, into L2 (1): a head's V rows while its scores are computed, the next head's
// K rows while its weighted values are (2.5 ms of a 150 ms decode step, measured: a step's layers
// of KV do not fit in cache, and a prefetch `ahead` keys before use is too late for memory).
template <int Locality = 3, typename T>
inline void prefetch(const T* p, int64_t dim) {
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, Locality);
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

// The rows of a K/V head `RB` at a time, each row's head dim `NV` vectors of `W` lanes.
template <typename T, int W, int NV>
struct Kernel {
  typedef typename Vec<T, W>::type V;
  static constexpr int RB = 16 / NV >= 4 ? 4 : 16 / NV >= 1 ? 16 / NV : 1;  // rows per pass (registers)

  // scores of rows[0 .. rb) over `count` keys from `keys`, written from `first` on in each row;
  // with `fetch`, the K rows of the keys `ahead` are prefetched, and their V rows into L2
  __attribute__((noinline)) static void score(Row<T>* rows, int rb, const T* pool, const int64_t* keys, int64_t count, int64_t first,
                     bool fetch, const Layout& at, int64_t h, T scale) {
    V qv[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < NV; ++v) qv[r][v] = load<V>(rows[std::min(r, rb - 1)].q + v * W);
    int64_t j = 0;
    for (; j + W <= count; j += W) {  // W keys at a time: their dots summed together
      for (int64_t l = 0; l < W; ++l)
        if (fetch && j + ahead + l < count) {
          const T* slot = pool + keys[j + ahead + l] * at.slot + h * at.kv_head;
          prefetch(slot, at.dim);
          prefetch<1>(slot + at.value, at.dim);  // its V row, for `weigh`
        }
      for (int r = 0; r < rb; ++r) {
        V dots[W];
        for (int l = 0; l < W; ++l) {
          const T* k = pool + keys[j + l] * at.slot + h * at.kv_head;
          V acc = qv[r][0] * load<V>(k);
          for (int v = 1; v < NV; ++v) acc = fmadd<T>(qv[r][v], load<V>(k + v * W), acc);
          dots[l] = acc;
        }
        V s = sums_of<T, W>(dots) * scale;
        std::memcpy(rows[r].scores + first + j, &s, sizeof s);
      }
    }
    for (; j < count; ++j) {
      const T* k = pool + keys[j] * at.slot + h * at.kv_head;
      V kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load<V>(k + v * W);
      for (int r = 0; r < rb; ++r) {
        V acc = qv[r][0] * kv[0];
        for (int v = 1; v < NV; ++v) acc = fmadd<T>(qv[r][v], kv[v], acc);
        rows[r].scores[first + j] = lanes_sum<T, W>(acc) * scale;
      }
    }
  }

  // the weighted values of rows[0 .. rb) over `count` keys from `keys`, their scores from `first` on;
  // with `fetch`, the V rows of the keys `ahead` are prefetched, and the next head's K rows into L2;
  // every accumulator is indexed by a constant (a fold over `I`), so it lives in a register. Both
  // passes stay out of line: inlined into `passes`' callbacks they ran 1.4x slower (measured).
  static void weigh(Row<T>* rows, int rb, const T* pool, const int64_t* keys, int64_t count, int64_t first,
                    bool fetch, const Layout& at, int64_t h) {
    weigh(rows, rb, pool, keys, count, first, fetch, at, h, std::make_index_sequence<RB * NV>{});
  }

  template <std::size_t... I>
  __attribute__((noinline)) static void weigh(Row<T>* rows, int rb, const T* pool, const int64_t* keys, int64_t count, int64_t first,
                    bool fetch, const Layout& at, int64_t h, std::index_sequence<I...>) {
    const T* weights[RB];
    for (int r = 0; r < RB; ++r) weights[r] = rows[std::min(r, rb - 1)].scores + first;
    V acc[RB * NV] = {load<V>(rows[std::min<int>(I / NV, rb - 1)].acc + (I % NV) * W)...};
    const int64_t offset = at.value + h * at.kv_head;
    for (int64_t j = 0; j < count; ++j) {
      const T* value = pool + keys[j] * at.slot + offset;
      if (fetch && j + ahead < count) {
        prefetch(pool + keys[j + ahead] * at.slot + offset, at.dim);
        if (h + 1 < at.kv_heads) prefetch<1>(pool + keys[j + ahead] * at.slot + (h + 1) * at.kv_head, at.dim);
      }
      V vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load<V>(value + v * W);
      T w[RB];
      for (int r = 0; r < RB; ++r) w[r] = weights[r][j];
      ((acc[I] = fmadd<T>(splat<V>(w[I / NV]), vv[I % NV], acc[I])), ...);
    }
    (store(rows, rb, static_cast<int>(I / NV), static_cast<int>(I % NV), acc[I]), ...);
  }

  static void store(Row<T>* rows, int rb, int r, int v, V x) {
    if (r < rb) std::memcpy(rows[r].acc + v * W, &x, sizeof x);
  }

  // `pass(rows, rb, keys, count, first, fetch)` over a K/V head's rows in key order, `RB` rows at a
  // time: the `m` shared keys a block of `KB` at a time for every row (the block stays in L1), then
  // each run of rows with the same own keys over those, which start at key `m` of each row. `fetch`:
  // whether the pass prefetches the keys' rows; only a block's first pass does (for the later ones
  // the block is in L1 already: their prefetches only took load slots, 2 ms of a 160 ms step).
  template <typename F>
  static void passes(std::vector<Row<T>>& rows, const int64_t* shared, int64_t m, const Plan& plan, F pass) {
    const int64_t R = rows.size();
    for (int64_t b = 0; b < m; b += KB)
      for (int64_t r = 0; r < R; r += RB)
        pass(&rows[r], static_cast<int>(std::min<int64_t>(RB, R - r)), shared + b, std::min(KB, m - b), b, r == 0);
    for (int64_t r = 0; r < R;) {
      int64_t e = r;
      while (e < R && e - r < RB && rows[e].own == rows[r].own) ++e;
      pass(&rows[r], static_cast<int>(e - r), plan.slots + rows[r].own, rows[r].n, m, true);
      r = e;
    }
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

  static void run(const T* q, const T* pool, const Plan& plan, const Layout& at, T scale, T* out, T* lse) {
    const int64_t groups = at.heads / at.kv_heads, dim = at.dim;
    std::vector<T> scores, accs;
    std::vector<Row<T>> rows;
    for (int64_t g = 0; g < plan.groups; ++g) {
      const int64_t* shared = plan.shared + plan.shared_offsets[g];
      const int64_t m = plan.shared_offsets[g + 1] - plan.shared_offsets[g];
      for (int64_t h = 0; h < at.kv_heads; ++h) {
        // the group's rows of this K/V head, segment by segment: query head h * groups + c, row i
        rows.clear();
        int64_t space = 0;
        for (int64_t s = plan.member_offsets[g]; s < plan.member_offsets[g + 1]; ++s) {
          const int64_t n = plan.key_offsets[s + 1] - plan.key_offsets[s];
          const int64_t width = plan.row_offsets[s + 1] - plan.row_offsets[s];
          for (int64_t c = 0; c < groups; ++c)
            for (int64_t i = 0; i < width; ++i) {
              const int64_t row = plan.rows[plan.row_offsets[s] + i], head = h * groups + c;
              rows.push_back(Row<T>{q + head * at.q_head + row * at.q_row, nullptr, nullptr, space,
                                    plan.key_offsets[s], n, std::min(n, plan.visible[s] + i),
                                    row * at.heads + head, 0, 0});
              space += (m + n + W - 1) / W * W;
            }
        }
        if (rows.empty()) continue;
        if (static_cast<int64_t>(scores.size()) < space) scores.resize(space);
        if (accs.size() < rows.size() * dim) accs.resize(rows.size() * dim);
        for (size_t r = 0; r < rows.size(); ++r) {
          rows[r].scores = scores.data() + rows[r].start;
          rows[r].acc = accs.data() + r * dim;
        }
        const int64_t R = rows.size();
        passes(rows, shared, m, plan, [&](Row<T>* first, int rb, const int64_t* keys, int64_t count, int64_t at_key, bool fetch) {
          score(first, rb, pool, keys, count, at_key, fetch, at, h, scale);
        });
        // softmax: each row's largest visible score, exp of the differences, their sum
        for (Row<T>& x : rows) {
          const int64_t seen = m + x.sees, padded = (m + x.n + W - 1) / W * W;
          for (int64_t j = seen; j < padded; ++j) x.scores[j] = -std::numeric_limits<T>::infinity();
          T top = max_of(x.scores, seen);
          V sum{};
          for (int64_t j = 0; j < padded; j += W) {
            V e = exp_nonpositive<T, W>(load<V>(x.scores + j) - top);
            std::memcpy(x.scores + j, &e, sizeof e);
            sum = sum + e;
          }
          x.top = top;
          x.total = lanes_sum<T, W>(sum);
        }
        // the weighted values in key order: shared keys a block at a time, then each segment's own
        std::fill(accs.begin(), accs.begin() + R * dim, T(0));
        passes(rows, shared, m, plan, [&](Row<T>* first, int rb, const int64_t* keys, int64_t count, int64_t at_key, bool fetch) {
          weigh(first, rb, pool, keys, count, at_key, fetch, at, h);
        });
        for (const Row<T>& x : rows) {
          T* o = out + x.out * dim;
          for (int64_t v = 0; v < NV; ++v) {
            V y = load<V>(x.acc + v * W) / x.total;
            std::memcpy(o + v * W, &y, sizeof y);
          }
          if (lse) lse[x.out] = x.top + std::log(x.total);
        }
      }
    }
  }
};

template <typename T, int W>
bool dispatch(int64_t nv, const T* q, const T* pool, const Plan& plan, const Layout& at, T scale, T* out,
              T* lse) {
#define KVB_CASE(N)                                                                               \
  case N:                                                                                         \
    Kernel<T, W, N>::run(q, pool, plan, at, scale, out, lse);                                    \
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

template <typename T>
int attend(const T* q, const T* pool, const int64_t* const* index, int64_t groups, const int64_t* layout,
           double scale, T* out, T* lse) {
  const Plan plan{index[0], index[1], index[2], index[3], index[4], index[5], index[6], index[7], groups};
  const Layout at{layout[0], layout[1], layout[2], layout[3], layout[4], layout[5], layout[6], layout[7]};
  if (at.kv_heads <= 0 || at.heads % at.kv_heads || at.dim <= 0) return 1;
  constexpr int wide = 64 / sizeof(T), narrow = 16 / sizeof(T);
  const T s = static_cast<T>(scale);
  if (at.dim % wide == 0 && dispatch<T, wide>(at.dim / wide, q, pool, plan, at, s, out, lse)) return 0;
  if (at.dim % narrow == 0 && dispatch<T, narrow>(at.dim / narrow, q, pool, plan, at, s, out, lse)) return 0;
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

}  // extern "C"
