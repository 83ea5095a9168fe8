// Batch-invariant matmul and RMSNorm on the CPU: every output row is computed by the same instructions in the
// same order whatever else is in the batch, so a row's result depends on that row's inputs alone.
//
// torch's own CPU matmul picks its kernel by the shape (a GEMV for one row, other paths for two or three rows
// and for four or more), and each kernel sums K in its own order: the same row of x gives logits a few ulps
// apart alone and in a batch. Here one dot product serves every (row, column) pair:
//
//   acc = eight partial sums, lane j taking k = j, j + 8, j + 16, ...  one fused multiply-add per step, in k order
//   tail: the last K % 8 values, zero-padded                          adds +0 products: no change to any sum
//   out  = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))           one fixed tree
//
// The tiles (up to 4 rows x 4 columns at once, so each load feeds several multiply-adds) and the threads (each
// owns whole columns) change only which dot products run together, never the arithmetic of one: the result is
// the same for any M, any row position, any thread count. No split-K, no kernel chosen by M.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Eight floats as one value, as in L3's kernel: SIMD registers where the CPU has them, scalar code otherwise.
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t kVec = 8;
constexpr int kTile = 4;          // rows and columns of the largest tile: 16 accumulators in registers
constexpr int64_t kRowBlock = 64;  // rows of x kept in cache while a column tile sweeps them (large M: prefill)
constexpr int64_t kColBlock = 16;  // columns of w a thread takes at a time

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x8 load8(const c10::BFloat16* p) {  // bf16 is an fp32's top half: widen by putting 16 zero bits below
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u16x16 bits = __builtin_shufflevector(u16x8{}, h, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15);
  f32x8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The last n < 8 values, zero-padded: the tail goes through the same multiply-add as every other chunk.
template <typename T>
inline f32x8 load_tail(const T* p, int64_t n) {
  T buf[kVec] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load8(buf);
}

// a * b + c with one rounding. Explicit, so that no compiler decision (contracting or not) can differ between
// two tiles: every dot product is the same chain of the same instruction.
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
#if defined(__FMA__)
  __m256 r = _mm256_fmadd_ps(reinterpret_cast<__m256&>(a), reinterpret_cast<__m256&>(b), reinterpret_cast<__m256&>(c));
  return reinterpret_cast<f32x8&>(r);
#else
  return a * b + c;
#endif
}

inline float tree8(f32x8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

inline void put(float* p, float v) { *p = v; }
inline void put(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }  // round to nearest even, as torch does

// A tile of R rows x C columns of out, each entry one dot product in the fixed order above: R and C decide
// which dot products share a load, never how one is summed
template <int R, int C, typename T>
void tile(const T* x, const T* w, T* out, int64_t k, int64_t n) {
  f32x8 acc[R][C] = {};
  const int64_t body = k / kVec * kVec;
  for (int64_t i = 0; i < body; i += kVec) {
    f32x8 wc[C];
    for (int c = 0; c < C; ++c) wc[c] = load8(w + c * k + i);
    for (int r = 0; r < R; ++r) {
      const f32x8 xc = load8(x + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = fma8(xc, wc[c], acc[r][c]);
    }
  }
  if (body < k) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = fma8(load_tail(x + r * k + body, k - body), load_tail(w + c * k + body, k - body), acc[r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) put(out + r * n + c, tree8(acc[r][c]));
}

template <typename T>
using TileFn = void (*)(const T*, const T*, T*, int64_t, int64_t);

template <typename T>
const TileFn<T> kTiles[kTile][kTile] = {
    {tile<1, 1, T>, tile<1, 2, T>, tile<1, 3, T>, tile<1, 4, T>},
    {tile<2, 1, T>, tile<2, 2, T>, tile<2, 3, T>, tile<2, 4, T>},
    {tile<3, 1, T>, tile<3, 2, T>, tile<3, 3, T>, tile<3, 4, T>},
    {tile<4, 1, T>, tile<4, 2, T>, tile<4, 3, T>, tile<4, 4, T>},
};

// out = x w^T over threads that each own whole column blocks, rows blocked for the cache
template <typename T>
void matmul(const T* x, const T* w, T* out, int64_t m, int64_t k, int64_t n) {
  at::parallel_for(0, (n + kColBlock - 1) / kColBlock, 1, [&](int64_t first, int64_t last) {
    for (int64_t cb = first; cb < last; ++cb) {
      const int64_t c0 = cb * kColBlock, c1 = std::min(n, c0 + kColBlock);
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t r1 = std::min(m, r0 + kRowBlock);
        for (int64_t c = c0; c < c1; c += kTile) {
          const int cols = static_cast<int>(std::min<int64_t>(kTile, c1 - c));
          for (int64_t r = r0; r < r1; r += kTile) {
            const int rows = static_cast<int>(std::min<int64_t>(kTile, r1 - r));
            kTiles<T>[rows - 1][cols - 1](x + r * k, w + c * k, out + r * n + c, k, n);
          }
        }
      }
    }
  });
}

// RMSNorm one row at a time: the sum of squares in the same fixed order for every row
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t e, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * e;
      f32x8 acc = {};
      const int64_t body = e / kVec * kVec;
      for (int64_t i = 0; i < body; i += kVec) {
        const f32x8 v = load8(xr + i);
        acc = fma8(v, v, acc);
      }
      if (body < e) {
        const f32x8 v = load_tail(xr + body, e - body);
        acc = fma8(v, v, acc);
      }
      // HF's Qwen3RMSNorm: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype), each product rounded to T
      const float scale = 1.0f / std::sqrt(tree8(acc) / static_cast<float>(e) + eps);
      for (int64_t i = 0; i < e; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * scale);
        put(out + r * e + i, static_cast<float>(normed) * static_cast<float>(weight[i]));
      }
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

}  // namespace

// x [..., K] and w [N, K] (nn.Linear's layout) in one dtype -> x w^T [..., N] in that dtype.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w_in) {
  check_cpu(x_in, "x");
  check_cpu(w_in, "w");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "x and w must share a dtype");
  TORCH_CHECK(w_in.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == w_in.size(1), "x [..., K] and w [N, K]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t k = w.size(1), n = w.size(0), m = x.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (x.scalar_type() == at::kFloat)
    matmul(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), m, k, n);
  else
    matmul(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), m, k, n);
  return out;
}

// x [..., E], weight [E] -> RMSNorm over the last dimension, in x's dtype.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_cpu(x_in, "x");
  TORCH_CHECK(weight_in.scalar_type() == x_in.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(weight_in.dim() == 1 && x_in.size(-1) == weight_in.size(0), "x [..., E] and weight [E]");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t e = weight.size(0), rows = x.numel() / std::max<int64_t>(e, 1);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, e, float(eps));
  else
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows,
                  e, float(eps));
  return out;
}

// Both release the GIL: they touch no Python object (L3's kernel does the same, for a server's event loop).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x w^T, each output a fixed-order dot product (no kernel chosen by M)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm row by row, each row's sum of squares in one fixed order",
        py::call_guard<py::gil_scoped_release>());
}
