// A quantized matrix-vector product for MLX's CPU backend on x86-64 that gives the same float32
// bits as MLX's own kernel, several times faster (voicechat/cpu_qmv.py says when it is used).
//
// MLX's x86 build has no SIMD for float (simd::max_size<float> == 1), so its affine quantized
// product x @ W.T runs `_qmm_t`: for each output row n, in k order,
//     sum += x[k] * (scale * float(q[n, k]) + bias)
// rounding after each multiply and add (the library has no FMA instructions). This kernel does
// the same operations in the same order for every row, with one row per lane of an AVX-512 or
// AVX2 register (qmv_kernel.h) instead of one scalar chain per row, and several rows of x per
// read of the weights (each row's chain its own). IEEE single multiply / add / int->float
// conversion round the same in a lane as in a scalar register, and the build turns FMA
// contraction off, so each output element is MLX's bit for bit (checked at load against
// mx.quantized_matmul, and by the tests).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "qmv_rows.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

template <typename S>
inline float to_float(S v) {
  return static_cast<float>(v);
}

// One output row in MLX's scalar order (rows left over after the vector blocks).
template <int bits, int G, typename S>
void row_scalar(float* out, const float* x, const uint32_t* w32, const S* sc, const S* bi, int K) {
  constexpr int mask = (1 << bits) - 1;
  constexpr int per_byte = 8 / bits;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w32);
  float sum = 0;
  for (int k = 0; k < K; k += G) {
    float s = to_float(*sc++);
    float b = to_float(*bi++);
    for (int kw = 0; kw < G / per_byte; kw++) {
      uint8_t wi = *w++;
      for (int p = 0; p < per_byte; p++) {
        sum += (*x++) * (s * static_cast<float>(wi & mask) + b);
        if (bits != 8) wi >>= bits;
      }
    }
  }
  *out = sum;
}

// The widest row kernels used: 2 AVX-512, 1 AVX2, 0 scalar only (the CPU's best unless lowered
// by set_isa, which the tests use to run every path on one machine).
int cpu_isa() {
  return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}
std::atomic<int> isa_in_use{cpu_isa()};

template <int bits, int G, typename S>
void qmv(float* out, const float* x, const uint32_t* w, const S* sc, const S* bi, int M, int N, int K) {
  const int isa = isa_in_use.load(std::memory_order_relaxed);
  const size_t words = K * bits / 32, groups = K / G;
  int n = 0;  // the vector kernels take every row of x for a block of weight rows (qmv_kernel.h)
  if (isa >= 2) n = voicechat_qmv::rows_avx512(bits, G, out, N, x, w, sc, bi, M, N, K);
  if (isa >= 1 && n < N) {  // the rows after the 16-lane blocks, 8 at a time
    n += voicechat_qmv::rows_avx2(bits, G, out + n, N, x, w + n * words, sc + n * groups, bi + n * groups, M, N - n,
                                  K);
  }
  for (; n < N; n++)
    for (int m = 0; m < M; m++)
      row_scalar<bits, G, S>(out + static_cast<size_t>(m) * N + n, x + static_cast<size_t>(m) * K, w + n * words,
                             sc + n * groups, bi + n * groups, K);
}

template <typename S>
void qmv_dispatch(int bits, int G, float* o, const float* x, const uint32_t* w, const S* s, const S* b,
                  int M, int N, int K) {
#define VOICECHAT_QMV_CASE(B, GS) \
  if (bits == B && G == GS) return qmv<B, GS, S>(o, x, w, s, b, M, N, K);
  VOICECHAT_QMV_CASE(4, 32)
  VOICECHAT_QMV_CASE(4, 64)
  VOICECHAT_QMV_CASE(4, 128)
  VOICECHAT_QMV_CASE(8, 32)
  VOICECHAT_QMV_CASE(8, 64)
  VOICECHAT_QMV_CASE(8, 128)
#undef VOICECHAT_QMV_CASE
  throw std::invalid_argument("cpu_qmv: bits must be 4 or 8 and group_size 32, 64 or 128");
}

// The array's elements in row-major order: its own buffer when it is row-contiguous, else a copy.
// Tasks keep their copies and scratch in thread_local buffers that only grow, so a task neither
// mallocs nor frees on the stream's worker thread (glibc's heap behaviour around MLX's large
// temporaries is what voicechat/heap.py settles; these buffers alone did not change it).
template <typename T>
const T* row_major(const mx::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) return a.data<T>();
  copy.resize(a.size());
  const T* src = a.data<T>();
  std::vector<int64_t> index(a.ndim(), 0);
  for (size_t i = 0; i < a.size(); i++) {
    int64_t loc = 0;
    for (int d = 0; d < a.ndim(); d++) loc += index[d] * a.strides()[d];
    copy[i] = src[loc];
    for (int d = a.ndim() - 1; d >= 0; d--) {
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
  return copy.data();
}

template <typename S>
void run(const mx::array& x, const mx::array& w, const mx::array& sc, const mx::array& bi, mx::array& out,
         int bits, int G) {
  thread_local std::vector<float> xc;
  thread_local std::vector<uint32_t> wc;
  thread_local std::vector<S> sc_c, bi_c;
  const int K = x.shape(-1);
  const int M = static_cast<int>(x.size() / K);
  const int N = out.shape(-1);
  qmv_dispatch<S>(bits, G, out.data<float>(), row_major<float>(x, xc), row_major<uint32_t>(w, wc),
                  row_major<S>(sc, sc_c), row_major<S>(bi, bi_c), M, N, K);
}

// An MLX primitive computed as one task on its CPU stream. The task gets the inputs and the outputs
// as weak copies (the encoder keeps their buffers alive until it has run) and a function that
// captures the primitive's parameters by value: the primitive itself may be gone by then.
class CpuTask : public mx::Primitive {
 public:
  using Task = std::function<void(const std::vector<mx::array>&, std::vector<mx::array>&)>;
  using mx::Primitive::Primitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in, out;
    for (auto& a : inputs) {
      encoder.set_input_array(a);
      in.push_back(mx::array::unsafe_weak_copy(a));
    }
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      encoder.set_output_array(o);
      out.push_back(mx::array::unsafe_weak_copy(o));
    }
    encoder.dispatch([task = task(), in = std::move(in), out = std::move(out)]() mutable { task(in, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("cpu_qmv: CPU streams only (MLX's own kernels serve the GPU)");
  }

  // One output: x's shape with its last axis replaced by the product's output columns.
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = columns(inputs);
    return {shape};
  }

 protected:
  virtual Task task() const = 0;
  virtual int columns(const std::vector<mx::array>& inputs) const { return inputs[0].shape(-1); }
};

class CpuQuantizedMatvec : public CpuTask {
 public:
  CpuQuantizedMatvec(mx::Stream stream, int group_size, int bits)
      : CpuTask(stream), group_size_(group_size), bits_(bits) {}

  const char* name() const override { return "CpuQuantizedMatvec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuQuantizedMatvec&>(other);
    return o.group_size_ == group_size_ && o.bits_ == bits_;
  }

 protected:
  int columns(const std::vector<mx::array>& inputs) const override { return inputs[1].shape(0); }  // w (N, K)

  Task task() const override {
    return [bits = bits_, G = group_size_](const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
      const auto &x = in[0], &w = in[1], &sc = in[2], &bi = in[3];
      auto& out = outs[0];
      switch (sc.dtype()) {
        case mx::float32: return run<float>(x, w, sc, bi, out, bits, G);
        case mx::bfloat16: return run<mx::bfloat16_t>(x, w, sc, bi, out, bits, G);
        case mx::float16: return run<mx::float16_t>(x, w, sc, bi, out, bits, G);
        default: throw std::invalid_argument("cpu_qmv: scales must be float32, bfloat16 or float16");
      }
    };
  }

 private:
  int group_size_;
  int bits_;
};

// ---- float32 products x @ Wt -------------------------------------------------------------------
// MLX's CPU matmul calls the Netlib reference sgemm, linked by MLX's Linux wheel: each output is
// the chain c = 0; for k ascending: c = c + x[m, k] * Wt[k, n], product and sum each rounded (no
// FMA). The vector kernels run L columns' chains in L lanes (qmv_kernel.h); the columns left over
// run the same chain one at a time.
inline float widen(float v) { return v; }
inline float widen(uint16_t bits) {  // a bf16 value's float32: its bits as the upper half (exact)
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// T: float (a float32 Wt) or uint16_t (a bfloat16 Wt's bits, widened to its float32 value, as
// MLX converts a bf16 operand before its float32 product).
template <typename T>
void matmul_f32(float* out, const float* x, const T* wt, int M, int N, int K) {
  const int isa = isa_in_use.load(std::memory_order_relaxed);
  int n = 0;
  if (isa >= 2) n = voicechat_qmv::rows_avx512_f32(out, N, x, wt, N, M, N, K);
  if (isa >= 1 && n < N) n += voicechat_qmv::rows_avx2_f32(out + n, N, x, wt + n, N, M, N - n, K);
  for (; n < N; n++) {
    for (int m = 0; m < M; m++) {
      float c = 0;
      for (int k = 0; k < K; k++) c = c + x[static_cast<size_t>(m) * K + k] * widen(wt[static_cast<size_t>(k) * N + n]);
      out[static_cast<size_t>(m) * N + n] = c;
    }
  }
}

class CpuMatmulF32 : public CpuTask {
 public:
  using CpuTask::CpuTask;

  const char* name() const override { return "CpuMatmulF32"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

 protected:
  int columns(const std::vector<mx::array>& inputs) const override { return inputs[1].shape(1); }  // wt (K, N)

  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      const auto &x = in[0], &wt = in[1];
      thread_local std::vector<float> xc, wc;
      thread_local std::vector<uint16_t> wc16;
      const int K = wt.shape(0), N = wt.shape(1);
      const int M = static_cast<int>(x.size() / K);
      if (wt.dtype() == mx::bfloat16)
        matmul_f32(out[0].data<float>(), row_major<float>(x, xc), row_major<uint16_t>(wt, wc16), M, N, K);
      else
        matmul_f32(out[0].data<float>(), row_major<float>(x, xc), row_major<float>(wt, wc), M, N, K);
    };
  }
};

// ---- batched matrix-vector products a @ x --------------------------------------------------------
// MLX's CPU matmul of a batch (..., P, K) @ (..., K, 1) calls the Netlib sgemm once per batch entry:
// each output is the chain c = 0; for k ascending: c = c + a[p, k] * x[k] (no FMA), one scalar
// call per entry (a Mamba-2 step's state-times-C per head). Here the whole batch is one task and
// each entry's P chains run 8 at a time (independent chains, the same operations in the same
// order). x has B / rep rows: entry b reads x row b / rep (x broadcast over a's innermost batch axis
// when rep > 1).
void batched_matvec_f32(float* out, const float* a, const float* x, int B, int rep, int P, int K) {
  constexpr int R = 8;
  for (int b = 0; b < B; b++) {
    const float* ab = a + static_cast<size_t>(b) * P * K;
    const float* xb = x + static_cast<size_t>(b / rep) * K;
    float* ob = out + static_cast<size_t>(b) * P;
    int p = 0;
    for (; p + R <= P; p += R) {
      float c[R] = {};
      const float* r = ab + static_cast<size_t>(p) * K;
      for (int k = 0; k < K; k++) {
        const float xv = xb[k];
        for (int i = 0; i < R; i++) c[i] = c[i] + r[static_cast<size_t>(i) * K + k] * xv;
      }
      for (int i = 0; i < R; i++) ob[p + i] = c[i];
    }
    for (; p < P; p++) {
      float c = 0;
      const float* r = ab + static_cast<size_t>(p) * K;
      for (int k = 0; k < K; k++) c = c + r[k] * xb[k];
      ob[p] = c;
    }
  }
}

class CpuBatchedMatvec : public CpuTask {
 public:
  using CpuTask::CpuTask;

  const char* name() const override { return "CpuBatchedMatvec"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  // a (..., P, K) @ x (..., K, 1) -> (..., P, 1)
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = 1;
    return {shape};
  }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      const auto &a = in[0], &x = in[1];
      thread_local std::vector<float> ac, xc;
      const int P = a.shape(-2), K = a.shape(-1);
      const int B = static_cast<int>(a.size() / (static_cast<size_t>(P) * K));
      const int Bx = static_cast<int>(x.size() / K);
      batched_matvec_f32(out[0].data<float>(), row_major<float>(a, ac), row_major<float>(x, xc), B, B / Bx, P, K);
    };
  }
};

// ---- norms over the last axis ------------------------------------------------------------------
// mx.fast.rms_norm / layer_norm on a CPU run as their compositions (mlx/fast.cpp): for float32 x,
//   rms:   y = x * (1 / sqrt(sum(x * x) * (1 / d) + eps))          [* w]
//   layer: mu = sum(x) * (1 / d); c = x - mu; y = c * (1 / sqrt(sum(c * c) * (1 / d) + eps)) [* w] [+ b]
// each operation rounded to float32, 1 / d rounded from double, and every sum the sequential chain
// of MLX's x86 reduction (no SIMD there: s = 0; s = s + v[k] for k ascending). Three dispatches
// (rms) or five (layer) per norm on MLX; one here, the same bits. Weight and bias of any float
// dtype are widened to float32 (exactly), as MLX's type promotion does.
void norm_rows(float* out, const float* x, const float* w, const float* b, size_t rows, int d, float eps,
               bool layer) {
  const float inv_d = static_cast<float>(1.0 / d);
  for (size_t r = 0; r < rows; r++, x += d, out += d) {
    float mu = 0;
    if (layer) {
      float s = 0;
      for (int k = 0; k < d; k++) s = s + x[k];
      mu = s * inv_d;
    }
    float s = 0;
    for (int k = 0; k < d; k++) {
      const float c = layer ? x[k] - mu : x[k];
      s = s + c * c;
    }
    const float scale = 1.0f / std::sqrt(s * inv_d + eps);
    for (int k = 0; k < d; k++) {
      float y = (layer ? x[k] - mu : x[k]) * scale;
      if (w) y = y * w[k];
      if (b) y = y + b[k];
      out[k] = y;
    }
  }
}

// A 1-D float array as float32 values (a copy unless it already is one, contiguous).
const float* widened(const mx::array& a, std::vector<float>& copy) {
  if (a.dtype() == mx::float32) return row_major<float>(a, copy);
  copy.resize(a.size());
  switch (a.dtype()) {
    case mx::bfloat16: {
      thread_local std::vector<mx::bfloat16_t> c;
      const auto* v = row_major<mx::bfloat16_t>(a, c);
      for (size_t i = 0; i < a.size(); i++) copy[i] = static_cast<float>(v[i]);
      break;
    }
    case mx::float16: {
      thread_local std::vector<mx::float16_t> c;
      const auto* v = row_major<mx::float16_t>(a, c);
      for (size_t i = 0; i < a.size(); i++) copy[i] = static_cast<float>(v[i]);
      break;
    }
    default: throw std::invalid_argument("cpu_qmv: norm weight / bias must be float32, bfloat16 or float16");
  }
  return copy.data();
}

class CpuNorm : public CpuTask {
 public:
  CpuNorm(mx::Stream stream, bool layer, bool has_weight, bool has_bias, float eps)
      : CpuTask(stream), layer_(layer), has_weight_(has_weight), has_bias_(has_bias), eps_(eps) {}

  const char* name() const override { return layer_ ? "CpuLayerNorm" : "CpuRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuNorm&>(other);
    return o.layer_ == layer_ && o.has_weight_ == has_weight_ && o.has_bias_ == has_bias_ && o.eps_ == eps_;
  }

 protected:
  Task task() const override {
    return [layer = layer_, hw = has_weight_, hb = has_bias_, eps = eps_](const std::vector<mx::array>& in,
                                                                         std::vector<mx::array>& out) {
      thread_local std::vector<float> xc, wc, bc;
      const int d = in[0].shape(-1);
      const float* w = hw ? widened(in[1], wc) : nullptr;
      const float* b = hb ? widened(in[hw ? 2 : 1], bc) : nullptr;
      norm_rows(out[0].data<float>(), row_major<float>(in[0], xc), w, b, in[0].size() / d, d, eps, layer);
    };
  }

 private:
  bool layer_, has_weight_, has_bias_;
  float eps_;
};

mx::array norm(const mx::array& x, const std::optional<mx::array>& weight, const std::optional<mx::array>& bias,
               float eps, bool layer, mx::StreamOrDevice s) {
  const char* what = layer ? "layer_norm" : "rms_norm";
  if (x.dtype() != mx::float32) throw std::invalid_argument(std::string("cpu_qmv: ") + what + " takes float32 x");
  if (x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument(std::string("cpu_qmv: ") + what + " needs x with a non-empty last axis");
  std::vector<mx::array> inputs = {x};
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const auto& a = p->value();
    if (a.ndim() != 1 || a.shape(0) != x.shape(-1))
      throw std::invalid_argument(std::string("cpu_qmv: ") + what + " weight / bias must be 1-D of x's last axis (" +
                                  std::to_string(x.shape(-1)) + ")");
    if (a.dtype() != mx::float32 && a.dtype() != mx::bfloat16 && a.dtype() != mx::float16)
      throw std::invalid_argument(std::string("cpu_qmv: ") + what + " weight / bias must be float32, bfloat16 or float16");
    inputs.push_back(a);
  }
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("cpu_qmv: a CPU stream is required");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<CpuNorm>(stream, layer, weight.has_value(), bias.has_value(), eps), inputs);
}

// ---- greedy residual vector quantization (EAR-TTS, one MoG pass) --------------------------------
// For each codebook q in turn, MLX's ops (voicechat/tts/ear_tts.py `_rvq_core`) compute
//   dot = residual @ books_t[q]   (the sgemm chain c = 0; c = c + r[k] * e[k, j], k ascending)
//   dist = norms[q] - 2 * dot;  j = argmin(dist) (the first NaN, else the first minimum)
//   residual = residual - books_t[q][:, j]
// five dispatches per codebook; here one task for the pass, the same operations in the same order.
void rvq_pass(int32_t* codes, float* residual, const float* books_t, const float* norms, int count, int latent,
              int C) {
  thread_local std::vector<float> dot;
  dot.resize(C);
  for (int q = 0; q < count; q++) {
    const float* book = books_t + static_cast<size_t>(q) * latent * C;
    matmul_f32<float>(dot.data(), residual, book, 1, C, latent);  // C >= 1 (rvq_pass_op)
    const float* norm = norms + static_cast<size_t>(q) * C;
    int best = 0;
    float best_d = norm[0] - 2.0f * dot[0];
    for (int j = 1; j < C; j++) {
      const float d = norm[j] - 2.0f * dot[j];
      if (std::isnan(best_d)) break;
      if (std::isnan(d) || d < best_d) {
        best_d = d;
        best = j;
      }
    }
    for (int k = 0; k < latent; k++) residual[k] = residual[k] - book[static_cast<size_t>(k) * C + best];
    codes[q] = best;
  }
}

class CpuRvqPass : public CpuTask {
 public:
  using CpuTask::CpuTask;

  const char* name() const override { return "CpuRvqPass"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  // (codes (count,), the remaining residual)
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[1].shape(0)}, inputs[0].shape()};
  }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      thread_local std::vector<float> rc, bc, nc;
      const auto &residual = in[0], &books_t = in[1], &norms = in[2];
      const int count = books_t.shape(0), latent = books_t.shape(1), C = books_t.shape(2);
      float* r = out[1].data<float>();
      const float* r0 = row_major<float>(residual, rc);
      std::copy(r0, r0 + latent, r);
      rvq_pass(out[0].data<int32_t>(), r, row_major<float>(books_t, bc), row_major<float>(norms, nc), count, latent,
               C);
    };
  }
};

std::vector<mx::array> rvq_pass_op(const mx::array& residual, const mx::array& books_t, const mx::array& norms,
                                   mx::StreamOrDevice s) {
  if (residual.dtype() != mx::float32 || books_t.dtype() != mx::float32 || norms.dtype() != mx::float32)
    throw std::invalid_argument("cpu_qmv: rvq_pass takes float32 residual, books_t and norms");
  if (books_t.ndim() != 3 || books_t.shape(0) < 1 || books_t.shape(1) < 1 || books_t.shape(2) < 1)
    throw std::invalid_argument("cpu_qmv: rvq_pass books_t must be (count >= 1, latent >= 1, C >= 1)");
  if (residual.size() != static_cast<size_t>(books_t.shape(1)) || residual.ndim() < 1 ||
      residual.shape(-1) != books_t.shape(1))
    throw std::invalid_argument("cpu_qmv: rvq_pass residual must be one row of books_t.shape[1] = " +
                                std::to_string(books_t.shape(1)) + " values");
  if (norms.shape() != mx::Shape{books_t.shape(0), books_t.shape(2)})
    throw std::invalid_argument("cpu_qmv: rvq_pass norms must be (count, C) = (" + std::to_string(books_t.shape(0)) +
                                ", " + std::to_string(books_t.shape(2)) + ")");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("cpu_qmv: a CPU stream is required");
  return mx::array::make_arrays({{books_t.shape(0)}, residual.shape()}, {mx::int32, mx::float32},
                                std::make_shared<CpuRvqPass>(stream), {residual, books_t, norms});
}

mx::array float32_matmul(const mx::array& x, const mx::array& wt, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || (wt.dtype() != mx::float32 && wt.dtype() != mx::bfloat16))
    throw std::invalid_argument("cpu_qmv: float32_matmul takes a float32 x and a float32 or bfloat16 wt");
  if (wt.ndim() != 2) throw std::invalid_argument("cpu_qmv: wt must be 2-D (K, N)");
  if (x.ndim() < 1 || x.shape(-1) != wt.shape(0))
    throw std::invalid_argument("cpu_qmv: x's last axis must be wt.shape[0] = " + std::to_string(wt.shape(0)));
  if (wt.shape(0) == 0) throw std::invalid_argument("cpu_qmv: K = 0 (MLX's own matmul serves it)");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("cpu_qmv: a CPU stream is required");
  auto shape = x.shape();
  shape.back() = wt.shape(1);
  return mx::array(shape, mx::float32, std::make_shared<CpuMatmulF32>(stream), {x, wt});
}

mx::array batched_matvec(const mx::array& a, const mx::array& x, mx::StreamOrDevice s) {
  if (a.dtype() != mx::float32 || x.dtype() != mx::float32)
    throw std::invalid_argument("cpu_qmv: batched_matvec takes float32 a and x");
  const int nd = a.ndim();
  if (nd < 3 || x.ndim() != nd || x.shape(-1) != 1 || x.shape(-2) != a.shape(-1))
    throw std::invalid_argument("cpu_qmv: batched_matvec takes a (..., P, K) and x (..., K, 1) with as many axes");
  bool same = true, inner = x.shape(nd - 3) == 1;
  for (int i = 0; i < nd - 2; i++) same = same && x.shape(i) == a.shape(i);
  for (int i = 0; i < nd - 3; i++) inner = inner && x.shape(i) == a.shape(i);
  if (!same && !inner)
    throw std::invalid_argument("cpu_qmv: batched_matvec: x's batch axes must be a's, or a's with the innermost one 1");
  if (a.shape(-1) == 0 || a.shape(-2) == 0 || a.size() == 0)
    throw std::invalid_argument("cpu_qmv: batched_matvec: empty a (MLX's own matmul serves it)");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("cpu_qmv: a CPU stream is required");
  auto shape = a.shape();
  shape.back() = 1;
  return mx::array(shape, mx::float32, std::make_shared<CpuBatchedMatvec>(stream), {a, x});
}

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("cpu_qmv: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("cpu_qmv: group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32) throw std::invalid_argument("cpu_qmv: x must be float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("cpu_qmv: w must be 2-D uint32");
  const int N = w.shape(0);
  const int K = w.shape(1) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != K)
    throw std::invalid_argument("cpu_qmv: x's last axis must be w.shape[1] * 32 / bits = " + std::to_string(K));
  if (scales.dtype() != biases.dtype() || scales.ndim() != 2 || biases.ndim() != 2 ||
      scales.shape(0) != N || biases.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape(1) != K / group_size)
    throw std::invalid_argument("cpu_qmv: scales and biases must be (N, K / group_size), one dtype");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("cpu_qmv: a CPU stream is required");
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(shape, mx::float32, std::make_shared<CpuQuantizedMatvec>(stream, group_size, bits),
                   {x, w, scales, biases});
}

}  // namespace

NB_MODULE(_voicechat_cpu_qmv, m) {
  m.doc() = "x @ dequantize(w).T for MLX's CPU backend, bit-identical to mx.quantized_matmul on x86-64";
  m.def("quantized_matvec", &quantized_matvec, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::kw_only(),
        nb::arg("stream") = nb::none());
  m.def("float32_matmul", &float32_matmul, nb::arg("x"), nb::arg("wt"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "x @ wt for float32 x (..., K) and wt (K, N): mx.matmul's bits on MLX's x86-64 CPU backend");
  m.def("batched_matvec", &batched_matvec, nb::arg("a"), nb::arg("x"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "a (..., P, K) @ x (..., K, 1) -> (..., P, 1), x's batch axes a's or a's with the innermost one 1: "
        "mx.matmul's bits on MLX's x86-64 CPU backend, one dispatch");
  m.def(
      "rms_norm",
      [](const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s) {
        return norm(x, weight, std::nullopt, eps, false, s);
      },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"), nb::kw_only(), nb::arg("stream") = nb::none(),
      "mx.fast.rms_norm's bits for float32 x on MLX's x86-64 CPU backend, one dispatch");
  m.def(
      "layer_norm",
      [](const mx::array& x, const std::optional<mx::array>& weight, const std::optional<mx::array>& bias, float eps,
         mx::StreamOrDevice s) { return norm(x, weight, bias, eps, true, s); },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("eps"), nb::kw_only(),
      nb::arg("stream") = nb::none(), "mx.fast.layer_norm's bits for float32 x on MLX's x86-64 CPU backend, one dispatch");
  m.def("rvq_pass", &rvq_pass_op, nb::arg("residual"), nb::arg("books_t"), nb::arg("norms"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "greedy RVQ of one float32 residual row over books_t (count, latent, C) with norms (count, C) -> "
        "(codes (count,) int32, the remaining residual): EAR-TTS's per-codebook MLX ops' bits, one dispatch");
  m.attr("MLX_VERSION") = VOICECHAT_MLX_VERSION;
  m.def("isa", [] { return isa_in_use.load(); }, "row kernels in use: 2 AVX-512, 1 AVX2, 0 scalar");
  m.def("cpu_isa", &cpu_isa, "the widest row kernels this CPU runs: 2 AVX-512, 1 AVX2, 0 scalar");
  m.def(
      "set_isa",
      [](int isa) {
        if (isa < 0 || isa > cpu_isa())
          throw std::invalid_argument("set_isa: 0 (scalar), 1 (AVX2) or 2 (AVX-512), at most cpu_isa() = " +
                                      std::to_string(cpu_isa()) + ", got " + std::to_string(isa));
        isa_in_use.store(isa);
      },
      nb::arg("isa"), "use row kernels up to this instruction set (for tests)");
}
