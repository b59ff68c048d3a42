// The row kernels of cpu_qmv.cpp, compiled once per instruction set (qmv_avx2.cpp,
// qmv_avx512.cpp set QMV_LANES and their own -m flags; the build turns FMA contraction off).
//
// Output rows are taken QMV_LANES at a time, one row per vector lane, a few vectors per step. Each
// lane runs MLX's scalar order for its row:
//     for k in groups, for each packed word, for each value p in it (low bits first):
//         sum += x[k] * (scale * float(q) + bias)
// The words of the lanes' rows are read a tile at a time and transposed; the scales and biases
// of a group are gathered (one gather per vector when they are float32).
//
// Several rows of x (a batch's sessions) share a block's reads and dequantization: up to
// QMV_RMAX rows of x at a time, each block of weight rows is loaded and t = scale * float(q) +
// bias computed once, then each row adds x[m][k] * t to its own sums. Row m's chain is exactly
// its single-row chain: the same t (computed the same way from the same values), its own product
// and sum rounded after each operation, k in the same order, no other row's value in it; so
// each output is bit for bit the row computed alone, and MLX's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "qmv_rows.h"

namespace voicechat_qmv {
namespace QMV_NS {

constexpr int L = QMV_LANES;
#ifndef QMV_BLOCK
#define QMV_BLOCK 4
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 256
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

inline vu gather_words(const uint32_t* base, vi index) {
#if QMV_LANES == 16
  return (vu)_mm512_i32gather_epi32((__m512i)index, base, 4);
#else
  return (vu)_mm256_i32gather_epi32(reinterpret_cast<const int*>(base), (__m256i)index, 4);
#endif
}

inline vf gather_floats(const float* base, vi index) {
#if QMV_LANES == 16
  return (vf)_mm512_i32gather_ps((__m512i)index, base, 4);
#else
  return (vf)_mm256_i32gather_ps(base, (__m256i)index, 4);
#endif
}

template <typename S>
inline vf load_lanes(const S* base, vi index) {
  if constexpr (std::is_same_v<S, float>) {
    return gather_floats(base, index);
  } else {
    vf out;
    for (int l = 0; l < L; l++) out[l] = static_cast<float>(base[index[l]]);
    return out;
  }
}

// Unaligned L-word load (the rows of a matrix start at any word).
typedef uint32_t vu_unaligned __attribute__((vector_size(4 * L), aligned(4)));
typedef float vf_unaligned __attribute__((vector_size(4 * L), aligned(4)));

// m[r][c] -> m[c][r] for an L x L tile of words, in log2(L) stages of two-input lane shuffles:
// each stage swaps the off-diagonal blocks of size `half` (Eklundh's transpose).
inline void transpose(vu* m) {
  for (int half = L / 2; half >= 1; half /= 2) {
    vi lo_mask, hi_mask;
    for (int j = 0; j < L; j++) {
      lo_mask[j] = (j & half) ? L + j - half : j;
      hi_mask[j] = (j & half) ? L + j : j + half;
    }
    for (int i = 0; i < L; i++) {
      if (i & half) continue;
      vu x = m[i], y = m[i + half];
      m[i] = __builtin_shuffle(x, y, (vu)lo_mask);
      m[i + half] = __builtin_shuffle(x, y, (vu)hi_mask);
    }
  }
}

// V * L consecutive output rows from n0, for R rows of x (x + r * K, out + r * ldo). The words are
// read L at a time from each weight row (one vector load per row), transposed so that vector i
// holds word i of every lane's row; words past the last whole tile of L are gathered one word per
// lane. Each value is dequantized once, t = scale * float(q) + bias, and then added to each of
// the R rows' sums: sum[r] = sum[r] + x[r][k] * t. Row r's chain is its single-row chain (the same
// t, the same product and sum, rounded alike, k in the same order); the rows only share the reads
// and the dequantization. The group size G is a run-time value (a group's first word found by a
// counter): one instantiation per bits, V, R and scale type keeps the build short, and measured
// no slower than a constant G.
template <int bits, int V, int R, typename S>
inline void rows_block(float* out, int ldo, const float* x, const uint32_t* w, const S* sc, const S* bi, int K, int G,
                       int n0) {
  constexpr int per_word = 32 / bits;
  constexpr uint32_t mask = (1u << bits) - 1;
  const int words = K / per_word, groups = K / G, words_per_group = G / per_word;
  vi word_index[V], group_index[V];
  for (int v = 0; v < V; v++)
    for (int l = 0; l < L; l++) {
      word_index[v][l] = (n0 + v * L + l) * words;
      group_index[v][l] = (n0 + v * L + l) * groups;
    }
  vf sum[R][V], s[V], b[V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) sum[r][v] = vf{};
  vu tile[V][L];
  const int tiled = words / L * L;
  for (int i = 0, g = 0, group_end = 0; i < words; i++) {
    if (i == group_end) {  // a group's first word: its scales and biases
      for (int v = 0; v < V; v++) {
        s[v] = load_lanes<S>(sc + g, group_index[v]);
        b[v] = load_lanes<S>(bi + g, group_index[v]);
      }
      g++;
      group_end += words_per_group;
    }
    if (i < tiled && i % L == 0) {
      for (int v = 0; v < V; v++) {
        for (int l = 0; l < L; l++) {
          const uint32_t* row = w + word_index[v][l] + i;
          tile[v][l] = *reinterpret_cast<const vu_unaligned*>(row);
          // The lanes' rows are read in parallel streams, too many for the hardware
          // prefetcher: fetch each row PREFETCH_BYTES ahead.
          __builtin_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES);
        }
        transpose(tile[v]);
      }
    }
    vu wv[V];
    for (int v = 0; v < V; v++) wv[v] = i < tiled ? tile[v][i % L] : gather_words(w + i, word_index[v]);
    // The word's values dequantized (t[p][v] for value p of vector v's lanes), then each row's
    // chain over them, k ascending.
    vf t[per_word][V];
#pragma GCC unroll 8
    for (int p = 0; p < per_word; p++)
#pragma GCC unroll 4
      for (int v = 0; v < V; v++) {
        vi q = (vi)((wv[v] >> (bits * p)) & mask);
        t[p][v] = s[v] * __builtin_convertvector(q, vf) + b[v];
      }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const float* xk = x + static_cast<size_t>(r) * K + i * per_word;
#pragma GCC unroll 8
      for (int p = 0; p < per_word; p++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) sum[r][v] = sum[r][v] + xk[p] * t[p][v];
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++)
      *reinterpret_cast<vf_unaligned*>(out + static_cast<size_t>(r) * ldo + v * L) = sum[r][v];
}

// Vectors per block (V) for R rows of x. One row: 8-bit rows in blocks of 2 vectors: a tile (L
// words of L rows) holds half as many 8-bit values as 4-bit ones, and 4 tiles spill out of the 32
// vector registers; measured here (AVX-512, one stream): (4096, 4096) 2.83 -> 2.04 ms, (22656,
// 4480) 16.5 -> 14.8 ms, the small16 language products 6.0 -> 4.5 ms per frame. 4-bit keeps 4 (2
// would take (4096, 4096) 1.31 -> 1.62 ms). Several rows: the R * V sums take registers, so fewer
// vectors as R grows: on AVX-512 4 (4-bit) / 2 (8-bit) up to 4 / 3 rows, then 1; AVX2's 8-lane
// vectors 4 up to 4 rows, then 2 (measured best for matrices streamed from memory).
#ifndef QMV_BLOCK8
#define QMV_BLOCK8 2
#endif
// Rows of x taken together (each block of weights read once for them).
#ifndef QMV_RMAX
#define QMV_RMAX 8
#endif
template <int bits, int R>
constexpr int block_vectors() {
  if constexpr (R == 1) return bits == 8 ? QMV_BLOCK8 : QMV_BLOCK;
  if constexpr (L == 8) return R <= 4 ? 4 : 2;
  if constexpr (bits == 8) return R <= 3 ? 2 : 1;
  return R <= 4 ? 4 : 1;
}

// The widest block any row count uses: the step over the output rows.
template <int bits>
constexpr int widest_block() {
  return []<int... R>(std::integer_sequence<int, R...>) {
    return std::max({block_vectors<bits, R + 1>()...});
  }(std::make_integer_sequence<int, QMV_RMAX>{});
}

// V * L output rows from n0 for all M rows of x, QMV_RMAX rows of x at a time (the last 1 to
// QMV_RMAX - 1 together), each group in blocks of its own width (a divisor of V). The block's
// weights (V * L rows of K) stay in cache between the groups of rows.
template <int bits, int V, typename S>
inline void rows_all(float* out, int ldo, const float* x, const uint32_t* w, const S* sc, const S* bi, int M, int K,
                     int G, int n0) {
  auto group = [&]<int R>(int m) {
    constexpr int VR = block_vectors<bits, R>() < V ? block_vectors<bits, R>() : V;
    static_assert(V % VR == 0);
    for (int v = 0; v < V; v += VR)
      rows_block<bits, VR, R, S>(out + static_cast<size_t>(m) * ldo + v * L, ldo, x + static_cast<size_t>(m) * K, w,
                                 sc, bi, K, G, n0 + v * L);
  };
  int m = 0;
  for (; m + QMV_RMAX <= M; m += QMV_RMAX) group.template operator()<QMV_RMAX>(m);
  [&]<int... R>(std::integer_sequence<int, R...>) {  // the remaining 1 to QMV_RMAX - 1 rows
    ((M - m == R + 1 ? group.template operator()<R + 1>(m) : void()), ...);
  }(std::make_integer_sequence<int, QMV_RMAX - 1>{});
}

// Output rows [0, n) (n a multiple of L, returned) of out (M, ldo) for x (M, K).
template <int bits, typename S>
int rows(float* out, int ldo, const float* x, const uint32_t* w, const S* sc, const S* bi, int M, int N, int K,
         int G) {
  constexpr int B = widest_block<bits>();
  int n = 0;
  for (; n + B * L <= N; n += B * L) rows_all<bits, B, S>(out + n, ldo, x, w, sc, bi, M, K, G, n);
  for (; n + L <= N; n += L) rows_all<bits, 1, S>(out + n, ldo, x, w, sc, bi, M, K, G, n);
  return n;
}

// ---- float32 products x (M, K) @ Wt (K, N), MLX's CPU bits ---------------------------------
// MLX's CPU matmul calls the Netlib reference sgemm, which forms each output as a chain over k
// ascending from zero: c += x[m, k] * Wt[k, n], rounding the product and the sum (no FMA). Here
// the chains of L consecutive columns run in one vector's lanes, V vectors and R rows of x at a
// time, so each row of Wt is read once per R rows instead of once per row.
// Wt is float32, or bfloat16 (as its uint16 bits): MLX multiplies a float32 x by a bf16 weight
// after converting the weight to float32 (exact: a bf16 value is the upper half of its float32),
// so widening each bf16 row in the registers (a 16-bit shift) gives the same chain on the same
// values, reading half the bytes and without the converted copy.
typedef uint16_t vh_unaligned __attribute__((vector_size(2 * L), aligned(2)));

inline vf load_row(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline vf load_row(const uint16_t* p) {
  vu wide = __builtin_convertvector(*reinterpret_cast<const vh_unaligned*>(p), vu);
  return (vf)(wide << 16);
}

template <int V, int R, typename T>
inline void f32_block(float* out, int ldo, const float* x, const T* wt, int ldw, int K) {
  vf acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = vf{};
  for (int k = 0; k < K; k++) {
    const T* row = wt + static_cast<size_t>(k) * ldw;
    vf wv[V];
    for (int v = 0; v < V; v++) wv[v] = load_row(row + v * L);
    for (int r = 0; r < R; r++) {
      const float xr = x[static_cast<size_t>(r) * K + k];
      for (int v = 0; v < V; v++) acc[r][v] = acc[r][v] + xr * wv[v];
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++)
      *reinterpret_cast<vf_unaligned*>(out + static_cast<size_t>(r) * ldo + v * L) = acc[r][v];
}

template <int V, typename T>
inline void f32_columns(float* out, int ldo, const float* x, const T* wt, int ldw, int M, int K) {
  int m = 0;
  for (; m + 4 <= M; m += 4) f32_block<V, 4>(out + static_cast<size_t>(m) * ldo, ldo, x + static_cast<size_t>(m) * K, wt, ldw, K);
  for (; m + 2 <= M; m += 2) f32_block<V, 2>(out + static_cast<size_t>(m) * ldo, ldo, x + static_cast<size_t>(m) * K, wt, ldw, K);
  for (; m < M; m++) f32_block<V, 1>(out + static_cast<size_t>(m) * ldo, ldo, x + static_cast<size_t>(m) * K, wt, ldw, K);
}

// Columns [0, n) of out for every row, n (a multiple of L, at most N) returned.
template <typename T>
inline int f32_cols(float* out, int ldo, const float* x, const T* wt, int ldw, int M, int N, int K) {
  int n = 0;
  for (; n + 4 * L <= N; n += 4 * L) f32_columns<4>(out + n, ldo, x, wt + n, ldw, M, K);
  for (; n + L <= N; n += L) f32_columns<1>(out + n, ldo, x, wt + n, ldw, M, K);
  return n;
}

}  // namespace QMV_NS

// The entry point of this instruction set: output rows [0, n) done for every row of x, n returned
// (a multiple of L).
#define QMV_ENTRY_CASES(S)                                                                \
  if (G != 32 && G != 64 && G != 128) return 0;                                            \
  if (bits == 4) return QMV_NS::rows<4, S>(out, ldo, x, w, sc, bi, M, N, K, G);            \
  if (bits == 8) return QMV_NS::rows<8, S>(out, ldo, x, w, sc, bi, M, N, K, G);            \
  return 0;

// The entry points of this instruction set: the float32 product's (float32 or bf16-bits Wt), and the
// quantized product's for float32 / bfloat16 / float16 scales.
#define QMV_DEFINE_ENTRIES(NAME)                                                                        \
  int NAME##_f32(float* out, int ldo, const float* x, const float* wt, int ldw, int M, int N, int K) {   \
    return QMV_NS::f32_cols(out, ldo, x, wt, ldw, M, N, K);                                             \
  }                                                                                                     \
  int NAME##_f32(float* out, int ldo, const float* x, const uint16_t* wt, int ldw, int M, int N, int K) {\
    return QMV_NS::f32_cols(out, ldo, x, wt, ldw, M, N, K);                                             \
  }                                                                                                     \
  int NAME(int bits, int G, float* out, int ldo, const float* x, const uint32_t* w, const float* sc,    \
           const float* bi, int M, int N, int K) {                                                      \
    QMV_ENTRY_CASES(float)                                                                              \
  }                                                                                                     \
  int NAME(int bits, int G, float* out, int ldo, const float* x, const uint32_t* w,                     \
           const mlx::core::bfloat16_t* sc, const mlx::core::bfloat16_t* bi, int M, int N, int K) {     \
    QMV_ENTRY_CASES(mlx::core::bfloat16_t)                                                              \
  }                                                                                                     \
  int NAME(int bits, int G, float* out, int ldo, const float* x, const uint32_t* w,                     \
           const mlx::core::float16_t* sc, const mlx::core::float16_t* bi, int M, int N, int K) {       \
    QMV_ENTRY_CASES(mlx::core::float16_t)                                                               \
  }

}  // namespace voicechat_qmv
