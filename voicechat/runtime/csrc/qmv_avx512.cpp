// The row kernels for AVX-512 (16 lanes); compiled with -mavx512f only (CMakeLists.txt), called only where the
// CPU has it (cpu_qmv.cpp).
#define QMV_NS avx512
#define QMV_LANES 16
#include "qmv_kernel.h"

namespace voicechat_qmv {
QMV_DEFINE_ENTRIES(rows_avx512)
}  // namespace voicechat_qmv
