// The row kernels for AVX2 (8 lanes); compiled with -mavx2 only (CMakeLists.txt), called only where the
// CPU has it (cpu_qmv.cpp).
#define QMV_NS avx2
#define QMV_LANES 8
#include "qmv_kernel.h"

namespace voicechat_qmv {
QMV_DEFINE_ENTRIES(rows_avx2)
}  // namespace voicechat_qmv
