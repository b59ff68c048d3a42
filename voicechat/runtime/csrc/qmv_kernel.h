// The row kernels of cpu_qmv.cpp, compiled once per instruction set (qmv_avx2.cpp,
// qmv_avx512.cpp set QMV_LANES and their own -m flags; the build turns FMA contraction off).
//
// Output rows are taken QMV_LANES at a time, one row per vector lane, 4 vectors per step. Each
// lane runs MLX's scalar order for its row:
//     for k in groups, for each packed word, for each value p in it (low bits first):
//         sum += x[k] * (scale * float(q) + bias)
// The words of the lanes' rows are fetched with one gather per vector; the scales and biases of
// a group likewise when they are float32.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

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

// V * L consecutive output rows from n0. The words are read L at a time from each row (one
// vector load per row), transposed so that vector i holds word i of every lane's row; words past
// the last whole tile of L are gathered one word per lane.
template <int bits, int G, int V, typename S>
inline void rows_block(float* out, const float* x, const uint32_t* w, const S* sc, const S* bi, int K, int n0) {
  constexpr int per_word = 32 / bits;
  constexpr int words_per_group = G / per_word;
  constexpr uint32_t mask = (1u << bits) - 1;
  const int words = K / per_word, groups = K / G;
  vi word_index[V], group_index[V];
  for (int v = 0; v < V; v++)
    for (int l = 0; l < L; l++) {
      word_index[v][l] = (n0 + v * L + l) * words;
      group_index[v][l] = (n0 + v * L + l) * groups;
    }
  vf sum[V], s[V], b[V];
  for (int v = 0; v < V; v++) sum[v] = vf{};
  vu tile[V][L];
  const int tiled = words / L * L;
  for (int i = 0; i < words; i++) {
    if (i % words_per_group == 0) {
      const int g = i / words_per_group;
      for (int v = 0; v < V; v++) {
        s[v] = load_lanes<S>(sc + g, group_index[v]);
        b[v] = load_lanes<S>(bi + g, group_index[v]);
      }
    }
    if (i < tiled && i % L == 0) {
      for (int v = 0; v < V; v++) {
        for (int r = 0; r < L; r++) {
          const uint32_t* row = w + word_index[v][r] + i;
          tile[v][r] = *reinterpret_cast<const vu_unaligned*>(row);
          // The lanes' rows are read in parallel streams, too many for the hardware
          // prefetcher: fetch each row PREFETCH_BYTES ahead.
          __builtin_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES);
        }
        transpose(tile[v]);
      }
    }
    vu wv[V];
    for (int v = 0; v < V; v++) wv[v] = i < tiled ? tile[v][i % L] : gather_words(w + i, word_index[v]);
    const float* xk = x + i * per_word;
#pragma GCC unroll 8
    for (int p = 0; p < per_word; p++) {
      const float xp = xk[p];
#pragma GCC unroll 4
      for (int v = 0; v < V; v++) {
        vi q = (vi)((wv[v] >> (bits * p)) & mask);
        vf t = s[v] * __builtin_convertvector(q, vf) + b[v];
        sum[v] = sum[v] + xp * t;
      }
    }
  }
  for (int v = 0; v < V; v++)
    for (int l = 0; l < L; l++) out[v * L + l] = sum[v][l];
}

// 8-bit rows in blocks of 2 vectors: a tile (L words of L rows) holds half as many 8-bit values
// as 4-bit ones, and 4 tiles spill out of the 32 vector registers; measured here (AVX-512, one
// stream): (4096, 4096) 2.83 -> 2.04 ms, (22656, 4480) 16.5 -> 14.8 ms, the small16 language
// products 6.0 -> 4.5 ms per frame. 4-bit keeps 4 (2 would take (4096, 4096) 1.31 -> 1.62 ms).
#ifndef QMV_BLOCK8
#define QMV_BLOCK8 2
#endif
template <int bits, int G, typename S>
int rows(float* out, const float* x, const uint32_t* w, const S* sc, const S* bi, int N, int K) {
  constexpr int B = bits == 8 ? QMV_BLOCK8 : QMV_BLOCK;
  int n = 0;
  for (; n + B * L <= N; n += B * L) rows_block<bits, G, B, S>(out + n, x, w, sc, bi, K, n);
  for (; n + L <= N; n += L) rows_block<bits, G, 1, S>(out + n, x, w, sc, bi, K, n);
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
typedef float vf_unaligned __attribute__((vector_size(4 * L), aligned(4)));
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

// The entry point of this instruction set: rows [0, n) done, n returned (a multiple of L).
#define QMV_ENTRY_CASES(S)                                                           \
  if (bits == 4 && G == 32) return QMV_NS::rows<4, 32, S>(out, x, w, sc, bi, N, K);   \
  if (bits == 4 && G == 64) return QMV_NS::rows<4, 64, S>(out, x, w, sc, bi, N, K);   \
  if (bits == 4 && G == 128) return QMV_NS::rows<4, 128, S>(out, x, w, sc, bi, N, K); \
  if (bits == 8 && G == 32) return QMV_NS::rows<8, 32, S>(out, x, w, sc, bi, N, K);   \
  if (bits == 8 && G == 64) return QMV_NS::rows<8, 64, S>(out, x, w, sc, bi, N, K);   \
  if (bits == 8 && G == 128) return QMV_NS::rows<8, 128, S>(out, x, w, sc, bi, N, K); \
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
  int NAME(int bits, int G, float* out, const float* x, const uint32_t* w, const float* sc,             \
           const float* bi, int N, int K) {                                                             \
    QMV_ENTRY_CASES(float)                                                                              \
  }                                                                                                     \
  int NAME(int bits, int G, float* out, const float* x, const uint32_t* w,                              \
           const mlx::core::bfloat16_t* sc, const mlx::core::bfloat16_t* bi, int N, int K) {            \
    QMV_ENTRY_CASES(mlx::core::bfloat16_t)                                                              \
  }                                                                                                     \
  int NAME(int bits, int G, float* out, const float* x, const uint32_t* w,                              \
           const mlx::core::float16_t* sc, const mlx::core::float16_t* bi, int N, int K) {              \
    QMV_ENTRY_CASES(mlx::core::float16_t)                                                               \
  }

}  // namespace voicechat_qmv
