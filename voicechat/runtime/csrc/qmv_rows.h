// The per-instruction-set row kernels (qmv_kernel.h): output rows [0, n) of out (M, ldo) = x (M, K) @ W.T
// computed for every row of x, n returned (0 when the bits / group size is not served). S: the
// scales' / biases' type.
// NAME_f32: columns [0, n) of the float32 product out (M, N) = x (M, K) @ Wt (K, N), n returned;
// Wt float32 or bfloat16 (its uint16 bits, widened exactly).
#pragma once

#include <cstdint>

#include "mlx/types/bf16.h"
#include "mlx/types/half_types.h"

namespace voicechat_qmv {

#define QMV_DECLARE(NAME)                                                                                 \
  int NAME(int bits, int G, float* out, int ldo, const float* x, const uint32_t* w, const float* sc,      \
           const float* bi, int M, int N, int K);                                                         \
  int NAME(int bits, int G, float* out, int ldo, const float* x, const uint32_t* w,                       \
           const mlx::core::bfloat16_t* sc, const mlx::core::bfloat16_t* bi, int M, int N, int K);        \
  int NAME(int bits, int G, float* out, int ldo, const float* x, const uint32_t* w,                       \
           const mlx::core::float16_t* sc, const mlx::core::float16_t* bi, int M, int N, int K);         \
  int NAME##_f32(float* out, int ldo, const float* x, const float* wt, int ldw, int M, int N, int K);     \
  int NAME##_f32(float* out, int ldo, const float* x, const uint16_t* wt, int ldw, int M, int N, int K);

QMV_DECLARE(rows_avx2)
QMV_DECLARE(rows_avx512)

#undef QMV_DECLARE
}  // namespace voicechat_qmv
