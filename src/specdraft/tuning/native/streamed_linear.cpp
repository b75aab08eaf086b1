// out[M, N] = x[M, K] . w[N, K]^T (+ bias) for a few rows M: each thread streams a contiguous run of weight rows
// once from memory and takes each row's dot product with every input row while the row sits in L1. That is a
// GEMV's memory traffic, which oneDNN's small-M kernels did not reach on the CPU measured (utils/streamed.py).
//
// Deterministic per row: a row's dot product is 16 lane sums over k (plain multiply and add: built with
// -ffp-contract=off and without fast-math), then a fixed tree over the lanes, then the tail in order, whichever
// other rows share the call. So a position's logits do not depend on how many tokens its forward held.
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

typedef float vec __attribute__((vector_size(64), aligned(4)));  // 16 floats, loaded unaligned
constexpr int kLanes = 16;

inline float tree_sum(const vec& a) {
  float b[8], c[4];
  for (int j = 0; j < 8; ++j) b[j] = a[j] + a[j + 8];
  for (int j = 0; j < 4; ++j) c[j] = b[j] + b[j + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// out[r, n] for input rows x[0..R) against weight row w (R = 1 or 2: more accumulators ran slower).
template <int R>
inline void dot_rows(const float* w, const float* x, int64_t K, float* out, int64_t N, int64_t n, const float* bias) {
  vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const vec wk = *reinterpret_cast<const vec*>(w + k);
    for (int r = 0; r < R; ++r) acc[r] += wk * *reinterpret_cast<const vec*>(x + r * K + k);
  }
  for (int r = 0; r < R; ++r) {
    float s = tree_sum(acc[r]);
    for (int64_t t = k; t < K; ++t) s += w[t] * x[r * K + t];
    out[r * N + n] = bias ? s + bias[n] : s;
  }
}

}  // namespace

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "streamed_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_cpu() && weight.is_cpu(),
              "streamed_linear: float32 CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "streamed_linear: contiguous x and weight only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "streamed_linear: bias [N] float32");
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* w = wp + n * K;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) dot_rows<2>(w, xp + m * K, K, op + m * N, N, n, b);
      for (; m < M; ++m) dot_rows<1>(w, xp + m * K, K, op + m * N, N, n, b);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("streamed_linear", &streamed_linear, "x [M, K] . weight [N, K]^T (+ bias), a few rows M, float32 CPU");
}
