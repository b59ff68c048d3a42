// The row kernels for AVX2 (8 lanes); compiled with -mavx2 only (CMakeLists.txt), called only
// where the CPU has it (cpu_qmv.cpp).
#define QMV_NS avx2
#define QMV_LANES 8
#include "qmv_kernel.h"

namespace voicechat_qmv {
int rows_avx2(int bits, int G, float* out, const float* x, const uint32_t* w, const float* sc, const float* bi,
            int N, int K) {
  QMV_ENTRY_CASES(float)
}
int rows_avx2(int bits, int G, float* out, const float* x, const uint32_t* w, const mlx::core::bfloat16_t* sc,
            const mlx::core::bfloat16_t* bi, int N, int K) {
  QMV_ENTRY_CASES(mlx::core::bfloat16_t)
}
int rows_avx2(int bits, int G, float* out, const float* x, const uint32_t* w, const mlx::core::float16_t* sc,
            const mlx::core::float16_t* bi, int N, int K) {
  QMV_ENTRY_CASES(mlx::core::float16_t)
}
}  // namespace voicechat_qmv
