// The row kernels for AVX-512 (16 lanes); compiled with -mavx512f only (CMakeLists.txt), called only
// where the CPU has it (cpu_qmv.cpp).
#define QMV_NS avx512
#define QMV_LANES 16
#include "qmv_kernel.h"

namespace voicechat_qmv {
int rows_avx512(int bits, int G, float* out, const float* x, const uint32_t* w, const float* sc, const float* bi,
            int N, int K) {
  QMV_ENTRY_CASES(float)
}
int rows_avx512(int bits, int G, float* out, const float* x, const uint32_t* w, const mlx::core::bfloat16_t* sc,
            const mlx::core::bfloat16_t* bi, int N, int K) {
  QMV_ENTRY_CASES(mlx::core::bfloat16_t)
}
int rows_avx512(int bits, int G, float* out, const float* x, const uint32_t* w, const mlx::core::float16_t* sc,
            const mlx::core::float16_t* bi, int N, int K) {
  QMV_ENTRY_CASES(mlx::core::float16_t)
}
}  // namespace voicechat_qmv
