// ssmspec_cpu::rows_linear(x, weight, bias): x [M, K] @ weight[N, K]^T + bias, float32, for the few rows of a CPU
// step (ssmspec.kernels.cpu_linear builds and loads this file; its reference is F.linear).
//
// Each task takes tiles of 8 weight rows and, for each, every row of x: a lone row against all 8 weight rows, pairs of
// rows against 4 at a time. Every weight vector loaded serves all of a block's rows, its 8 sums run side by side in
// registers (enough independent chains to keep both FMA units busy), and the tile stays in the core's cache for the
// next pair of rows, so the weights are read from memory once per product whatever its rows. A block's sums are
// reduced 4 at a time by one network of horizontal adds and stored as one vector, instead of one reduction per output.
// Each output is summed in the same order whatever M is and whichever rows it shares a block with: a row's result is
// the same alone and among any number of rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();

// the sums of 4 accumulators (lanes added pairwise, then the halves), into s[0..4)
inline void reduce4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* s) {
#if defined(CPU_CAPABILITY_AVX512)
  auto half = [](const Vec& v) {
    const __m512 z = v;
    return _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  const Vec* a[4] = {&a0, &a1, &a2, &a3};
  for (int j = 0; j < 4; j++) {
    float lanes[L];
    a[j]->store(lanes);
    float t = 0.f;
    for (int64_t i = 0; i < L; i++) t += lanes[i];
    s[j] = t;
  }
#endif
}

// y[m, n .. n + NB) for m < MR: MR x NB sums in flight over K (its last partial vector loaded with zeros past K), each
// weight vector loaded once for the MR rows; NB <= 8, reduced 4 at a time (a group of fewer padded with zeros)
template <int MR, int NB>
inline void block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                  int64_t n, const float* bias) {
  Vec acc[MR][NB];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NB; j++) acc[m][j] = Vec(0.f);
  // the products of one vector's width of K at k, its values read by `load`
  auto add = [&](int64_t k, auto load) {
    Vec wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = load(w + (n + j) * ldw + k);
    for (int m = 0; m < MR; m++) {
      const Vec xv = load(x + m * ldx + k);
      for (int j = 0; j < NB; j++) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  };
  int64_t k = 0;
  for (; k + L <= K; k += L) add(k, [](const float* p) { return Vec::loadu(p); });
  if (k < K) add(k, [rest = K - k](const float* p) { return Vec::loadu(p, rest); });
  const Vec zero(0.f);
  for (int m = 0; m < MR; m++) {
    for (int j = 0; j < NB; j += 4) {
      float s[4];
      reduce4(acc[m][j], j + 1 < NB ? acc[m][j + 1] : zero, j + 2 < NB ? acc[m][j + 2] : zero,
              j + 3 < NB ? acc[m][j + 3] : zero, s);
      for (int i = 0; i < 4 && j + i < NB; i++) y[m * ldy + n + j + i] = bias ? s[i] + bias[n + j + i] : s[i];
    }
  }
}

// every row of y at the weight rows [n, n + NB) (NB = 8: a tile; fewer: the weight's last rows): pairs of rows 4
// weight rows at a time, a row left alone against all NB
template <int NB>
inline void rows_at(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw, int64_t K, float* y,
                    int64_t ldy, int64_t n, const float* bias) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    if constexpr (NB > 4) {
      block<2, 4>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias);
      block<2, NB - 4>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n + 4, bias);
    } else {
      block<2, NB>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias);
    }
  }
  if (m < M) block<1, NB>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias);
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "ssmspec_cpu::rows_linear: x and weight must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "ssmspec_cpu::rows_linear: float32 only, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.size(1) == weight.size(1), "ssmspec_cpu::rows_linear: x has ", x.size(1), " columns, weight ",
              weight.size(1));
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor bc;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "ssmspec_cpu::rows_linear: bias must be float32 of shape [", N, "]");
    bc = bias->contiguous();
    b = bc.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return b ? y.copy_(bc.expand({M, N})) : y.zero_();
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = xc.stride(0), ldw = wc.stride(0);
  // the weight's rows split between the threads in tiles of 8, at least ~32K multiply-adds a task (a small product
  // runs on the calling thread)
  const int64_t tiles = N / 8;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 8 * M * K));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) rows_at<8>(xp, ldx, M, wp, ldw, K, yp, N, 8 * t, b);
  });
  const int64_t n = tiles * 8;
  switch (N - n) {  // the weight's last N % 8 rows
    case 7: rows_at<7>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    case 6: rows_at<6>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    case 5: rows_at<5>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    case 4: rows_at<4>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    case 3: rows_at<3>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    case 2: rows_at<2>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    case 1: rows_at<1>(xp, ldx, M, wp, ldw, K, yp, N, n, b); break;
    default: break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(ssmspec_cpu, m) { m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(ssmspec_cpu, CPU, m) { m.impl("rows_linear", &rows_linear); }
