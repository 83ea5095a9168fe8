// The decode step's CPU ops: a matmul that reads each weight once at the memory rate for a few rows, and the
// elementwise work of a layer fused into a handful of calls. Every lesson's model uses them on the CPU
// (shared/cpu_ops.py); L14 uses the same matmul for every row count, which is what makes its mode invariant.
//
// A decode step multiplies 1 to 16 rows of activations by every weight matrix of the model: the work is reading
// the weights, not the arithmetic (one multiply-add per weight per row). So the weights stream through once, in
// tiles of up to 4 columns, and each weight vector loaded feeds every row of the tile at once.
//
// One dot product serves every (row, column) pair, the same for any M, any row position, any thread count:
//
//   acc  = one vector of partial sums, lane j taking k = j, j + L, j + 2L, ...  one multiply-add per step, in k order
//   tail = the last K % L values, zero-padded                                   adds +0 products: no change to any sum
//   out  = the lanes summed by one fixed tree (halves added until one is left)
//
// L, the lanes, is the CPU's: 16 floats with AVX-512, 8 with AVX2 (or portable code), so a result is the same on
// one machine for every batch, and may differ between an AVX-512 and an AVX2 machine. In bf16 a CPU with AVX-512
// BF16 multiplies pairs of bf16 values straight into fp32 sums (vdpbf16ps, 32 values a step); elsewhere bf16 is
// widened to fp32 (the top half of a float) and takes the fp32 path. No split-K, no kernel chosen by M: tiles and
// threads change only which dot products run together, never the arithmetic of one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int kTile = 4;           // rows and columns of the largest tile: 16 accumulators in registers
constexpr int64_t kRowBlock = 64;  // rows of x kept in cache while a column tile sweeps them (large M: prefill)
constexpr int64_t kColBlock = 64;  // columns of w a thread takes at a time

// Dot<T>: how one step of a dot product loads and multiplies. `In` is a loaded vector of T, `Acc` the fp32 sums,
// kStep the values one step consumes.
#if defined(__AVX512F__)
inline float sum_lanes(__m512 v) {  // 16 -> 8 -> 4 -> 2 -> 1, the same tree for every output
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <typename T> struct Dot;
template <> struct Dot<float> {
  using In = __m512;
  using Acc = __m512;
  static constexpr int64_t kStep = 16;
  static In load(const float* p) { return _mm512_loadu_ps(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm512_fmadd_ps(x, w, acc); }
};
#if defined(__AVX512BF16__)
template <> struct Dot<bf16> {  // vdpbf16ps: acc[j] += x[2j] w[2j] + x[2j+1] w[2j+1], products exact in fp32
  using In = __m512i;
  using Acc = __m512;
  static constexpr int64_t kStep = 32;
  static In load(const bf16* p) { return _mm512_loadu_si512(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
};
#else
template <> struct Dot<bf16> {  // bf16 is an fp32's top half: widen by shifting 16 zero bits in below
  using In = __m512;
  using Acc = __m512;
  static constexpr int64_t kStep = 16;
  static In load(const bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Acc madd(Acc acc, In x, In w) { return _mm512_fmadd_ps(x, w, acc); }
};
#endif
inline Dot<float>::Acc zero_acc() { return _mm512_setzero_ps(); }

#elif defined(__AVX2__) && defined(__FMA__)
inline float sum_lanes(__m256 v) {  // 8 -> 4 -> 2 -> 1
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <typename T> struct Dot;
template <> struct Dot<float> {
  using In = __m256;
  using Acc = __m256;
  static constexpr int64_t kStep = 8;
  static In load(const float* p) { return _mm256_loadu_ps(p); }
  static Acc madd(Acc acc, In x, In w) { return _mm256_fmadd_ps(x, w, acc); }
};
template <> struct Dot<bf16> {
  using In = __m256;
  using Acc = __m256;
  static constexpr int64_t kStep = 8;
  static In load(const bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Acc madd(Acc acc, In x, In w) { return _mm256_fmadd_ps(x, w, acc); }
};
inline Dot<float>::Acc zero_acc() { return _mm256_setzero_ps(); }

#else  // portable: GCC/Clang vector extensions, whatever the target makes of them
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
inline float sum_lanes(f32x8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

template <typename T> struct Dot;
template <> struct Dot<float> {
  using In = f32x8;
  using Acc = f32x8;
  static constexpr int64_t kStep = 8;
  static In load(const float* p) {
    In v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static Acc madd(Acc acc, In x, In w) { return acc + x * w; }
};
template <> struct Dot<bf16> {
  using In = f32x8;
  using Acc = f32x8;
  static constexpr int64_t kStep = 8;
  static In load(const bf16* p) {
    u16x8 h;
    std::memcpy(&h, p, sizeof h);
    const u16x16 bits = __builtin_shufflevector(u16x8{}, h, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15);
    In v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  static Acc madd(Acc acc, In x, In w) { return acc + x * w; }
};
inline Dot<float>::Acc zero_acc() { return f32x8{}; }
#endif

// The last n < kStep values, zero-padded: the tail goes through the same multiply-add as every other step.
template <typename T>
inline typename Dot<T>::In load_tail(const T* p, int64_t n) {
  alignas(64) T buf[Dot<T>::kStep] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return Dot<T>::load(buf);
}

inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { *p = bf16(v); }  // round to nearest even, as torch does

// A tile of R rows x C columns of out, each entry one dot product in the fixed order above: R and C decide
// which dot products share a load, never how one is summed
template <int R, int C, typename T>
void tile(const T* x, const T* w, T* out, int64_t k, int64_t n, int64_t) {
  using D = Dot<T>;
  typename D::Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero_acc();
  const int64_t body = k / D::kStep * D::kStep;
  for (int64_t i = 0; i < body; i += D::kStep) {
    typename D::In wc[C];
    for (int c = 0; c < C; ++c) wc[c] = D::load(w + c * k + i);
    // The next tile's weights, the same line of each: its streams start warm, a tile (C rows of K) ahead of use.
    // Past the last tile this names memory beyond w: a prefetch never faults, it is only a hint.
    for (int c = 0; c < C; ++c) __builtin_prefetch(w + (C + c) * k + i);
    for (int r = 0; r < R; ++r) {
      const typename D::In xr = D::load(x + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = D::madd(acc[r][c], xr, wc[c]);
    }
  }
  if (body < k) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = D::madd(acc[r][c], load_tail(x + r * k + body, k - body), load_tail(w + c * k + body, k - body));
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) put(out + r * n + c, sum_lanes(acc[r][c]));
}

// A tile function: x's rows, w's first column (a row of w, nn.Linear's layout), out, K, N, and the bytes or
// elements from one row of w to the next
template <typename T, typename W>
using TileFn = void (*)(const T*, const W*, T*, int64_t, int64_t, int64_t);
template <typename T, typename W>
using TileTable = TileFn<T, W>[kTile][kTile];

template <typename T>
const TileTable<T, T> kTiles = {
    {tile<1, 1, T>, tile<1, 2, T>, tile<1, 3, T>, tile<1, 4, T>},
    {tile<2, 1, T>, tile<2, 2, T>, tile<2, 3, T>, tile<2, 4, T>},
    {tile<3, 1, T>, tile<3, 2, T>, tile<3, 3, T>, tile<3, 4, T>},
    {tile<4, 1, T>, tile<4, 2, T>, tile<4, 3, T>, tile<4, 4, T>},
};

// out = x w^T over threads that each own whole column blocks; a column block's weights come from memory once
// and stay in cache while every row tile (of a few rows, or of a prefill's row block) passes over them.
// `stride` is one row of w in W's units: K for dense weights, a row's blocks in bytes for quantized ones.
template <typename T, typename W>
void matmul(const T* x, const W* w, T* out, int64_t m, int64_t k, int64_t n, int64_t stride,
            const TileTable<T, W>& tiles) {
  at::parallel_for(0, (n + kColBlock - 1) / kColBlock, 1, [&](int64_t first, int64_t last) {
    for (int64_t cb = first; cb < last; ++cb) {
      const int64_t c0 = cb * kColBlock, c1 = std::min(n, c0 + kColBlock);
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t r1 = std::min(m, r0 + kRowBlock);
        for (int64_t c = c0; c < c1; c += kTile) {
          const int cols = static_cast<int>(std::min<int64_t>(kTile, c1 - c));
          for (int64_t r = r0; r < r1; r += kTile) {
            const int rows = static_cast<int>(std::min<int64_t>(kTile, r1 - r));
            tiles[rows - 1][cols - 1](x + r * k, w + c * stride, out + r * n + c, k, n, stride);
          }
        }
      }
    }
  });
}

// Weight blocks as GGUF stores them (llama.cpp's ggml-common.h), 32 weights each, read from the file as shipped:
//   Q8_0: fp16 d, 32 int8 q                        (34 bytes)  w = d q
//   Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q      (20 bytes)  w = d q + m; byte j holds q_j low, q_{j+16} high
// A step of the dot product dequantizes its L weights in registers to exactly the values gguf's dequantize writes,
// and takes the fp32 path's multiply-add in the fp32 path's k order. So a quantized matmul's every output is bitwise
// the fp32 matmul's over the dequantized weights: the same products of the same values, summed in the same order.
// The values are exact for a simple reason: d q needs at most 11 + 8 significant bits (an fp16 d, a q of 4 or 8
// bits), so fp32 holds it exactly, and d q + m rounds once, the sum, whether or not the compiler fuses the two.
constexpr int64_t kBlock = 32;

inline float half_at(const uint8_t* p) {  // an unaligned fp16, exactly as fp32 (every fp16 is an fp32)
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__) && defined(__AVX2__)  // immintrin.h is included with AVX2
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

using F32 = Dot<float>;

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  struct Scales { float d; };
  static Scales scales(const uint8_t* b) { return {half_at(b)}; }
  // The L weights starting at o (a multiple of L) of the block at b.
  static F32::In load(const uint8_t* b, Scales s, int64_t o) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2) + o;
#if defined(__AVX512F__)
    const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    return _mm512_mul_ps(qf, _mm512_set1_ps(s.d));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    return _mm256_mul_ps(qf, _mm256_set1_ps(s.d));
#else
    float buf[F32::kStep];
    for (int64_t j = 0; j < F32::kStep; ++j) buf[j] = s.d * static_cast<float>(q[j]);  // one rounding: no FMA to fear
    return F32::load(buf);
#endif
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
#if defined(__AVX512F__)
  // A block's sixteen possible weights, d q + m for q = 0..15, computed once a block: a step then looks its sixteen
  // up by nibble (vpermps reads an index's low four bits) instead of converting, multiplying and adding them
  struct Scales { __m512 table; };
  static Scales scales(const uint8_t* b) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_add_ps(_mm512_mul_ps(q, _mm512_set1_ps(half_at(b))), _mm512_set1_ps(half_at(b + 2)))};
  }
  static F32::In load(const uint8_t* b, Scales s, int64_t o) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    return _mm512_permutexvar_ps(o < 16 ? bytes : _mm512_srli_epi32(bytes, 4), s.table);  // low nibbles, then high
  }
#else
  struct Scales { float d, m; };
  static Scales scales(const uint8_t* b) { return {half_at(b), half_at(b + 2)}; }
  static F32::In load(const uint8_t* b, Scales s, int64_t o) {
    const uint8_t* q = b + 4 + o % 16;  // weights o..o+L-1: low nibbles (o < 16) or high nibbles of these bytes
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i nib = o < 16 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(nib), _mm256_set1_ps(s.d), _mm256_set1_ps(s.m));  // d q is exact
#else
    float buf[F32::kStep];
    for (int64_t j = 0; j < F32::kStep; ++j) {
      const uint8_t byte = q[j];
      buf[j] = s.d * static_cast<float>(o < 16 ? byte & 15 : byte >> 4) + s.m;
    }
    return F32::load(buf);
#endif
  }
#endif
};

// The quantized tile: blocks of each column's row in k order, each block's steps in k order: the dense tile's
// order exactly (K is a whole number of blocks, and a block a whole number of steps, so there is no tail)
template <int R, int C, typename F>
void qtile(const float* x, const uint8_t* w, float* out, int64_t k, int64_t n, int64_t stride) {
  F32::Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero_acc();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blocks[C];
    typename F::Scales s[C];
    for (int c = 0; c < C; ++c) {
      blocks[c] = w + c * stride + b * F::kBytes;
      s[c] = F::scales(blocks[c]);
      __builtin_prefetch(blocks[c] + C * stride);  // the next tile's block: its streams start warm
    }
    for (int64_t o = 0; o < kBlock; o += F32::kStep) {
      F32::In wc[C];
      for (int c = 0; c < C; ++c) wc[c] = F::load(blocks[c], s[c], o);
      for (int r = 0; r < R; ++r) {
        const F32::In xr = F32::load(x + r * k + b * kBlock + o);
        for (int c = 0; c < C; ++c) acc[r][c] = F32::madd(acc[r][c], xr, wc[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) put(out + r * n + c, sum_lanes(acc[r][c]));
}

template <typename F>
const TileTable<float, uint8_t> kQTiles = {
    {qtile<1, 1, F>, qtile<1, 2, F>, qtile<1, 3, F>, qtile<1, 4, F>},
    {qtile<2, 1, F>, qtile<2, 2, F>, qtile<2, 3, F>, qtile<2, 4, F>},
    {qtile<3, 1, F>, qtile<3, 2, F>, qtile<3, 3, F>, qtile<3, 4, F>},
    {qtile<4, 1, F>, qtile<4, 2, F>, qtile<4, 3, F>, qtile<4, 4, F>},
};

// Every weight of `rows` rows of blocks as fp32, gguf's arithmetic (a prefill's GEMM and the embedding use it)
template <typename F>
void dequantize_rows(const uint8_t* w, float* out, int64_t rows, int64_t k) {
  const int64_t stride = k / kBlock * F::kBytes;
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const uint8_t* block = w + r * stride + b * F::kBytes;
        const typename F::Scales s = F::scales(block);
        for (int64_t o = 0; o < kBlock; o += F32::kStep) {
          const F32::In v = F::load(block, s, o);
          std::memcpy(out + r * k + b * kBlock + o, &v, sizeof v);
        }
      }
  });
}

// A row's sum of squares in one fixed order (the matmul's dot product of the row with itself, widened to fp32)
template <typename T>
float sum_of_squares(const T* x, int64_t e) {
  using D = Dot<float>;
  D::Acc acc = zero_acc();
  float buf[D::kStep];
  for (int64_t i = 0; i < e; i += D::kStep) {
    const int64_t n = std::min<int64_t>(D::kStep, e - i);
    for (int64_t j = 0; j < D::kStep; ++j) buf[j] = j < n ? static_cast<float>(x[i + j]) : 0.0f;
    const D::In v = D::load(buf);
    acc = D::madd(acc, v, v);
  }
  return sum_lanes(acc);
}

// HF's Qwen3RMSNorm on one row: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype), each product rounded to T
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t e, float eps) {
  const float scale = 1.0f / std::sqrt(sum_of_squares(x, e) / static_cast<float>(e) + eps);
  for (int64_t i = 0; i < e; ++i) {
    const T normed = static_cast<T>(static_cast<float>(x[i]) * scale);
    put(out + i, static_cast<float>(normed) * static_cast<float>(weight[i]));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t e, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) norm_row(x + r * e, weight, out + r * e, e, eps);
  });
}

// out = silu(gate) * up, each rounded to T as torch's two ops round: silu(g) = g / (1 + exp(-g))
template <typename T>
void silu_mul_n(const T* gate, const T* up, T* out, int64_t n) {
  at::parallel_for(0, n, 4096, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const float g = static_cast<float>(gate[i]);
      const T silu = static_cast<T>(g / (1.0f + std::exp(-g)));
      put(out + i, static_cast<float>(silu) * static_cast<float>(up[i]));
    }
  });
}

// RoPE rounds each product and the sum, as torch's three ops do: no fused multiply-add may join them (in fp32 a
// contracted x cos + s sin would differ from HF in the last bit), whatever -ffp-contract the build defaults to.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// Per head of x [T, H, D]: NeoX RoPE with the step's tables, out = x cos + swap_halves(x) signed_sin, each product
// and the sum rounded to T
template <typename T>
void rope_heads(const T* x, const T* cos, const T* sin, T* out, int64_t t, int64_t h, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, t * h, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const T* head = x + row * d;
      const int64_t tok = row / h;
      const T* c = cos + tok * d;
      const T* s = sin + tok * d;
      for (int64_t j = 0; j < d; ++j) {
        const float swapped = static_cast<float>(head[j < half ? j + half : j - half]);
        const T a = static_cast<T>(static_cast<float>(head[j]) * static_cast<float>(c[j]));
        const T b = static_cast<T>(swapped * static_cast<float>(s[j]));
        put(out + row * d + j, static_cast<float>(a) + static_cast<float>(b));
      }
    }
  });
}

#pragma GCC pop_options

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  check_cpu(b, what);
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "x and ", what, " must share a dtype");
}

// Calls f with the tensors' element type: float or bf16.
template <typename F>
void by_dtype(const at::Tensor& t, F f) {
  if (t.scalar_type() == at::kFloat)
    f(float{});
  else
    f(bf16{});
}

}  // namespace

// x [..., K] and w [N, K] (nn.Linear's layout) in one dtype -> x w^T [..., N] in that dtype.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w_in) {
  check_cpu(x_in, "x");
  check_same(x_in, w_in, "w");
  TORCH_CHECK(w_in.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == w_in.size(1), "x [..., K] and w [N, K]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t k = w.size(1), n = w.size(0), m = x.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  by_dtype(x, [&](auto t) {
    using T = decltype(t);
    matmul(x.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), m, k, n, k, kTiles<T>);
  });
  return out;
}

// x [..., E], weight [E] -> RMSNorm over the last dimension, in x's dtype.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_cpu(x_in, "x");
  check_same(x_in, weight_in, "weight");
  TORCH_CHECK(weight_in.dim() == 1 && x_in.size(-1) == weight_in.size(0), "x [..., E] and weight [E]");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t e = weight.size(0), rows = x.numel() / std::max<int64_t>(e, 1);
  at::Tensor out = at::empty_like(x);
  by_dtype(x, [&](auto t) {
    using T = decltype(t);
    rms_norm_rows(x.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), rows, e, float(eps));
  });
  return out;
}

// gate, up [..., I] -> silu(gate) * up [..., I].
at::Tensor silu_mul(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_cpu(gate_in, "gate");
  check_same(gate_in, up_in, "up");
  TORCH_CHECK(gate_in.sizes() == up_in.sizes(), "gate and up must have one shape");
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate);
  by_dtype(gate, [&](auto t) {
    using T = decltype(t);
    silu_mul_n(gate.data_ptr<T>(), up.data_ptr<T>(), out.data_ptr<T>(), gate.numel());
  });
  return out;
}

// x [T, H, D], cos and signed sin [T, 1, D] (RotaryEmbedding.tables) -> the heads rotated, [T, H, D].
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_cpu(x_in, "x");
  check_same(x_in, cos_in, "cos");
  check_same(x_in, sin_in, "sin");
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(2) % 2 == 0, "x [T, H, D] with an even D");
  const int64_t t = x_in.size(0), h = x_in.size(1), d = x_in.size(2);
  TORCH_CHECK(cos_in.numel() == t * d && sin_in.numel() == t * d, "cos and sin [T, 1, D]");
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  at::Tensor out = at::empty_like(x);
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    rope_heads(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), out.data_ptr<T>(), t, h, d);
  });
  return out;
}

// Calls f with the block format a name selects ("q8_0" or "q4_1").
template <typename F>
void by_format(const std::string& format, F f) {
  if (format == "q8_0")
    f(Q8_0{});
  else if (format == "q4_1")
    f(Q4_1{});
  else
    TORCH_CHECK(false, "unknown block format ", format, ": q8_0 or q4_1");
}

// The row of blocks for K weights in a format, checked against the tensor holding them.
int64_t check_blocks(const at::Tensor& w, const std::string& format, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2, "blocks must be a CPU uint8 [N, bytes]");
  TORCH_CHECK(k > 0 && k % kBlock == 0, "K must be a positive multiple of 32, got ", k);
  int64_t stride = 0;
  by_format(format, [&](auto f) { stride = k / kBlock * decltype(f)::kBytes; });
  TORCH_CHECK(w.size(1) == stride, format, " rows of ", k, " weights take ", stride, " bytes, not ", w.size(1));
  return stride;
}

// x [..., K] fp32 and w [N, K / 32 blocks] of a format -> x w^T [..., N] fp32, each output the fp32 matmul's over
// the dequantized weights, bit for bit.
at::Tensor linear_blocks(const at::Tensor& x_in, const at::Tensor& w_in, const std::string& format) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  const int64_t k = x_in.size(-1);
  const int64_t stride = check_blocks(w_in, format, k);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t n = w.size(0), m = x.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  by_format(format, [&](auto f) {
    matmul(x.data_ptr<float>(), w.data_ptr<uint8_t>(), out.data_ptr<float>(), m, k, n, stride,
           kQTiles<decltype(f)>);
  });
  return out;
}

// w [N, K / 32 blocks] of a format -> every weight as fp32 [N, K], gguf's dequantize bit for bit.
at::Tensor dequantize(const at::Tensor& w_in, const std::string& format, int64_t k) {
  check_blocks(w_in, format, k);
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty({w.size(0), k}, w.options().dtype(at::kFloat));
  by_format(format, [&](auto f) {
    dequantize_rows<decltype(f)>(w.data_ptr<uint8_t>(), out.data_ptr<float>(), w.size(0), k);
  });
  return out;
}

// Which code this build runs: the matmul's lanes and whether bf16 uses the CPU's bf16 dot products.
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512+bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

// All release the GIL: they touch no Python object (a server's event loop keeps running beside a step).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x w^T, each output a fixed-order dot product (no kernel chosen by M)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm row by row, each row's sum of squares in one fixed order",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, "NeoX RoPE with a step's cos and signed sin", py::call_guard<py::gil_scoped_release>());
  m.def("linear_blocks", &linear_blocks, "x w^T over GGUF weight blocks, bitwise the fp32 matmul of the dequantized weights",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "GGUF weight blocks -> fp32, as gguf dequantizes",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", &isa, "the instruction set this build's matmul uses");
}
