// ssmspec_cpu::rows_linear(x, weight, bias): x [M, K] @ weight[N, K]^T + bias, float32, for the few rows of a CPU
// step (ssmspec.kernels.cpu_linear builds and loads this file; its reference is F.linear).
//
// Each task takes tiles of 4 weight rows and, for each, every row of x, up to 4 at a time: every weight vector loaded
// is used for all of those rows, the MR x NB sums run side by side in registers, and the tile stays in the core's
// cache for the next group of rows, so the weights are read from memory once per product whatever its rows.
// Inductor's loops sum each output in one chain of dependent vector additions, a row at a time, so their products run
// at the adder's latency and each row of a verify step adds its own pass over the weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

namespace {

using Vec = at::vec::Vectorized<float>;

// y[m, n .. n + NB) for m < MR: MR x NB sums in flight, each weight vector loaded once for the MR rows
template <int MR, int NB>
inline void block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                  int64_t n, const float* bias) {
  constexpr int64_t L = Vec::size();
  Vec acc[MR][NB];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NB; j++) acc[m][j] = Vec(0.f);
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    Vec wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = Vec::loadu(w + (n + j) * ldw + k);
    for (int m = 0; m < MR; m++) {
      const Vec xv = Vec::loadu(x + m * ldx + k);
      for (int j = 0; j < NB; j++) acc[m][j] = at::vec::fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; m++) {
    for (int j = 0; j < NB; j++) {
      float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[m][j]);
      for (int64_t t = k; t < K; t++) s += x[m * ldx + t] * w[(n + j) * ldw + t];
      y[m * ldy + n + j] = bias ? s + bias[n + j] : s;
    }
  }
}

// MR rows of y at the weight rows [n, n + 4) (a tile): the tile's 4 x K weights stay in the core's cache for every
// group of rows, so a step's weights are read from memory once whatever its row count
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                 int64_t n, const float* bias) {
  if constexpr (MR == 4 || MR == 3) {
    block<MR, 2>(x, ldx, w, ldw, K, y, ldy, n, bias);
    block<MR, 2>(x, ldx, w, ldw, K, y, ldy, n + 2, bias);
  } else {
    block<MR, 4>(x, ldx, w, ldw, K, y, ldy, n, bias);
  }
}

// every row of y at the weight rows [n, n + 4): groups of 4 rows, then the 1 to 3 left
inline void rows_at(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw, int64_t K, float* y,
                    int64_t ldy, int64_t n, const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias);
  switch (M - m) {
    case 3: tile<3>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias); break;
    case 2: tile<2>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias); break;
    case 1: tile<1>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias); break;
    default: break;
  }
}

// the weight's last N % 4 rows, one at a time, for every row of y
inline void rows_tail(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw, int64_t K, float* y,
                      int64_t ldy, int64_t n, const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<4, 1>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias);
  for (; m < M; m++) block<1, 1>(x + m * ldx, ldx, w, ldw, K, y + m * ldy, ldy, n, bias);
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
  // the weight's rows split between the threads in tiles of 4, at least ~32K multiply-adds a task (a small product
  // runs on the calling thread)
  const int64_t tiles = N / 4;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 4 * M * K));
  auto each_tile = [&](auto&& f) {
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; t++) f(4 * t);
    });
  };
  switch (M) {  // (up to 4 rows: one group, its tile's code chosen once)
    case 1: each_tile([&](int64_t n) { tile<1>(xp, ldx, wp, ldw, K, yp, N, n, b); }); break;
    case 2: each_tile([&](int64_t n) { tile<2>(xp, ldx, wp, ldw, K, yp, N, n, b); }); break;
    case 3: each_tile([&](int64_t n) { tile<3>(xp, ldx, wp, ldw, K, yp, N, n, b); }); break;
    case 4: each_tile([&](int64_t n) { tile<4>(xp, ldx, wp, ldw, K, yp, N, n, b); }); break;
    default: each_tile([&](int64_t n) { rows_at(xp, ldx, M, wp, ldw, K, yp, N, n, b); }); break;
  }
  for (int64_t n = tiles * 4; n < N; n++) rows_tail(xp, ldx, M, wp, ldw, K, yp, N, n, b);
  return y;
}

}  // namespace

TORCH_LIBRARY(ssmspec_cpu, m) { m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(ssmspec_cpu, CPU, m) { m.impl("rows_linear", &rows_linear); }
