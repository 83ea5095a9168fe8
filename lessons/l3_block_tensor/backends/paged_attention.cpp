// Paged attention on the CPU: every request's new tokens attend over K/V read in place from the pages its
// block table names. Nothing is gathered into a padded copy first; this is what FlashInfer's kernels do on
// a GPU, and it takes exactly their inputs: the CSR page tables (qo_indptr, kv_indptr, kv_indices,
// kv_last_page_len) and one layer's NHD pool [num_blocks, S, Hkv, D].
//
// Plan once per step, run once per layer (FlashInfer's split). `plan` checks the tables and cuts the step into
// work items: one request b, a tile of up to kTileRows of its query rows and its KV heads (all of them, unless
// there are more threads than tiles: then a range). Every layer's `run` reuses that list. A lane is one
// (query row, query head) pair of the item: a decode row has Hq lanes, a prefill tile up to kTileRows times
// as many. A KV head's lanes are its GQA group's query heads on each of the tile's rows.
//
//   for each page p of b                            block id kv_indices[kv_indptr[b] + p]
//     for each KV head of the item                  its K and V rows in the page: [S, D], S rows apart
//       scores of all its lanes against its K rows  a register-blocked micro-kernel (score_page): each K
//                                                   row loaded once for several lanes at a time; keys past
//                                                   the page's last visible one are not scored
//       online-softmax update, per lane             rescale the lane's sum and accumulator if its max grew;
//                                                   weights = exp(score - max), a vector polynomial (exp8);
//                                                   keys past the lane's causal limit get weight 0
//       accumulators += weights x V rows            two lanes at a time share each V row load
//   output = accumulator / sum, per lane
//
// K, V and q are read in their own dtype and widened to fp32 in registers as they are loaded (bf16: a shift),
// so there is no fp32 copy of a page. Work items are independent, so they run in parallel over torch's
// intra-op threads, each thread taking the next item, longest first, until none are left.
//
// Blocks between `// >>> L12` and `// <<< L12` are L12's (int8 KV pages), added to this file so one kernel
// reads both pools; reading L3, skip them: the code outside them is L3's kernel, whole.
// >>> L12: int8 pages carry each row's fp32 scale in the row's last 4 bytes ([N, S, Hkv, D + 4]): a key
// row's scale multiplies its scores, a value row's its softmax weights, so the rows are widened from int8
// and never dequantized into memory either.
// <<< L12
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Query rows of one request that share each page read (prefills, slices). Every tile walks all of its request's
// pages, so smaller tiles read the same K/V again and again: on 4 slices of 64 rows after 640-token histories
// tiles of 8, 16 and 32 rows took 1.45 : 1.18 : 1 of the time (one thread, a 2-core Zen3).
constexpr int64_t kTileRows = 32;

struct Shape {
  int64_t hq, hkv, group, d, s;  // query heads, KV heads, query heads per KV head, head dim, block size
  int64_t row;                   // elements of one KV head's row in the pool: d (L12's rows are longer)
};

// One work item, as one row of the plan's int64 tensor [items, kItemFields].
enum ItemField : int64_t {
  kRequest,
  kRowBegin, kRowEnd,  // rows of the flat query stream, all of one request
  kFirstPos,           // position of the request's first new row: kv_len - (rows it feeds)
  kRow0,               // the request's first row in the stream (qo_indptr[request])
  kChunk, kChunks,     // the item attends with KV heads [chunk * Hkv / chunks, (chunk + 1) * Hkv / chunks)
  kItemFields
};

// Eight floats as one value. GCC and Clang put it in the machine's SIMD registers (AVX, AVX-512, NEON) or,
// without any, in plain scalar code: the vector loops below are portable, and fast where the CPU allows.
// Its meaning is eight floats whatever the register width, so the results do not depend on the machine.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t kVec = 8;  // floats in one f32x8

// Eight values from memory, widened to fp32 in registers: the kernel never copies a page to convert it.
inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

// bf16 is the top half of an fp32: widening puts each value's 16 bits above 16 zero bits. Written as one
// interleave with zeros (little-endian: the high half is the second), which AVX2 does in two instructions;
// the same as a zero-extend and a shift, which GCC 12 compiled into five (bf16 decode: 0.75x the time).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "load8(bf16) puts the high half second");
inline f32x8 load8(const c10::BFloat16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u16x16 bits = __builtin_shufflevector(u16x8{}, h, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15);
  f32x8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// >>> L12: int8 codes and their scales
typedef int8_t i8x8 __attribute__((vector_size(8)));
constexpr int64_t kScaleBytes = sizeof(float);  // an int8 row's scale, stored after its D codes

// int8 codes, widened to fp32. On AVX2 two instructions (sign-extend to int32, convert). The
// portable form, one __builtin_convertvector, is what GCC 12 compiles into eight scalar loads and inserts:
// int8 decode attention then took 2.9x bf16's time (one thread, a 2-core EPYC), so x86 gets the intrinsics.
inline f32x8 load8(const int8_t* p) {
#if defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  f32x8 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  i8x8 c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, f32x8);
#endif
}

// int8 pages: the scales of n rows (`stride` apart), each stored after its row's d codes.
inline void row_scales(const int8_t* rows, int64_t n, int64_t stride, int64_t d, float* scales) {
  for (int64_t t = 0; t < n; ++t) std::memcpy(scales + t, rows + t * stride + d, sizeof(float));
}

// x[l * ws + t] *= scales[t] for `lanes` lanes and t < n: a key's scale on its scores, a value's on its weights.
inline void scale_keys(float* x, int64_t lanes, int64_t ws, const float* scales, int64_t n) {
  for (int64_t l = 0; l < lanes; ++l)
    for (int64_t t = 0; t < n; ++t) x[l * ws + t] *= scales[t];
}
// <<< L12

template <typename T>  // fp16, fp64: converted one value at a time (rare on a CPU; correct, not fast)
inline f32x8 load8(const T* p) {
  f32x8 v;
  for (int i = 0; i < kVec; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

inline float sum8(f32x8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Element j of the result is the sum of a[j]'s eight floats: eight horizontal sums in 7 adds, transposing as
// it adds (pairs of neighbours, then pairs of pairs, then halves), where eight separate sums take 8 x 7.
inline f32x8 sum8x8(const f32x8 a[8]) {
  const auto pairs = [](f32x8 x, f32x8 y) {  // [x0+x1, y0+y1, x2+x3, y2+y3, ...]
    return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  const auto quads = [](f32x8 x, f32x8 y) {  // four vectors' sums of elements 0-3, then of elements 4-7
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  const f32x8 lo = quads(pairs(a[0], a[1]), pairs(a[2], a[3])), hi = quads(pairs(a[4], a[5]), pairs(a[6], a[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp of eight floats at once, for x <= 0 (a score minus its running max), within 2 ulp of std::exp: the
// polynomial of Cephes' expf, which fast CPU attention kernels use in the same way. std::exp is a function
// call per value, one at a time; a decode step of the bench computes about 64,000 of them.
//   e^x = 2^n * e^r with n = round(x / ln2) and r = x - n ln2, so |r| <= ln2 / 2;
//   e^r by a degree-7 polynomial (1 + r + r^2 (p0 + p1 r + ... + p5 r^5)), accurate to float precision there;
//   2^n built directly as a float's bits: exponent field n + 127, mantissa 0.
// Below -87 the result would be a denormal or 0; x is clamped there (e^-87 ~ 1.6e-38, nothing next to a
// weight of 1 in the same sum). -inf is clamped too, so it does not give exactly 0: callers that need 0
// (keys a row must not see) mask the weight.
inline f32x8 exp8(f32x8 x) {
  const f32x8 lowest = f32x8{} - 87.0f;
  x = x < lowest ? lowest : x;  // a vector select: elementwise
  const f32x8 round = f32x8{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const f32x8 n = (x * 1.44269504088896341f + round) - round;
  const f32x8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, ln2 in two parts for precision
  f32x8 p = f32x8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const i32x8 pow2n = (__builtin_convertvector(n, i32x8) + 127) << 23;  // 2^n: n + 127 in the exponent bits
  f32x8 scale;
  std::memcpy(&scale, &pow2n, sizeof scale);
  return p * scale;
}

// The dot products of L query lanes with T key rows (L * T = 8) over d floats: eight sums in eight registers,
// each key chunk loaded once for all L lanes and each query chunk once for all T keys (6 loads per 8 multiply-
// adds at L = 2, T = 4, where one lane against one key is 2 loads per multiply-add). Result element l * T + t.
template <int L, int T, typename KT>
inline f32x8 dot_block(const float* const q[L], const KT* const k[T], int64_t d) {
  static_assert(L * T == 8, "one f32x8 of results");
  f32x8 acc[8] = {};
  for (int64_t i = 0; i < d; i += kVec) {
    f32x8 kc[T];
    for (int t = 0; t < T; ++t) kc[t] = load8(k[t] + i);
    for (int l = 0; l < L; ++l) {
      const f32x8 qc = load8(q[l] + i);
      for (int t = 0; t < T; ++t) acc[l * T + t] += qc * kc[t];
    }
  }
  return sum8x8(acc);
}

// scores[l * ws + t] = q lane l . key t, for `lanes` lanes (q rows d floats apart) and keys t < n of one KV
// head (rows `stride` elements apart), in blocks of L lanes x T keys. A block past the last lane or key
// repeats the last one (always valid memory) and its extra results are dropped.
template <int L, int T, typename KT>
void score_page(const float* q, int64_t lanes, const KT* k, int64_t n, int64_t stride, int64_t d, float* scores,
                int64_t ws) {
  for (int64_t l0 = 0; l0 < lanes; l0 += L) {
    const float* ql[L];
    for (int l = 0; l < L; ++l) ql[l] = q + std::min(l0 + l, lanes - 1) * d;
    for (int64_t t0 = 0; t0 < n; t0 += T) {
      const KT* kt[T];
      for (int t = 0; t < T; ++t) kt[t] = k + std::min(t0 + t, n - 1) * stride;
      const f32x8 r = dot_block<L, T>(ql, kt, d);
      float block[8];
      store8(block, r);
      const int64_t keys = std::min<int64_t>(T, n - t0);  // T, but at the page's last keys
      for (int l = 0; l < L && l0 + l < lanes; ++l)
        std::memcpy(scores + (l0 + l) * ws + t0, block + l * T, keys * sizeof(float));
    }
  }
}

inline void scale_by(float* x, float c, int64_t d) {
  for (int64_t i = 0; i < d; i += kVec) store8(x + i, load8(x + i) * c);
}

// One lane's online-softmax step over a page: its scores s[0, n) become weights, s[n, ws) zeros (keys it must
// not see, and padding), and the lane's running max m, sum and accumulator acc [d] are brought up to date.
inline void softmax_page(float* s, int64_t n, int64_t ws, float& m, float& sum, float* acc, int64_t d) {
  if (n == 0) {  // an early prefill row: this whole page is in its future
    std::fill(s, s + ws, 0.f);
    return;
  }
  // The page's max, eight keys at a time: a scalar max over random scores mispredicts its branch every few keys.
  const i32x8 first = {0, 1, 2, 3, 4, 5, 6, 7};
  const f32x8 none = f32x8{} - std::numeric_limits<float>::infinity();
  f32x8 most = none;
  for (int64_t t = 0; t < n; t += kVec) {
    const f32x8 x = (first + static_cast<int32_t>(t)) < static_cast<int32_t>(n) ? load8(s + t) : none;
    most = most > x ? most : x;
  }
  const float page_max = std::max(std::max(std::max(most[0], most[1]), std::max(most[2], most[3])),
                                  std::max(std::max(most[4], most[5]), std::max(most[6], most[7])));
  // Weights so far were exp(score - old max). A larger max shrinks them all by exp(old max - new max): the
  // sum and the accumulator are rescaled once, here, not per key.
  if (page_max > m) {
    const float shrink = std::exp(m - page_max);  // 0 on the lane's first page (m = -inf, sum = acc = 0)
    sum *= shrink;
    scale_by(acc, shrink, d);
    m = page_max;
  }
  f32x8 total = {};
  for (int64_t t = 0; t < ws; t += kVec) {
    const f32x8 w = exp8(load8(s + t) - m);
    const f32x8 seen = (first + static_cast<int32_t>(t)) < static_cast<int32_t>(n) ? w : f32x8{};  // 0 past n
    store8(s + t, seen);
    total += seen;
  }
  sum += sum8(total);
}

// acc[l] += sum over t < n of w[l * ws + t] * V row t, for `lanes` lanes (accumulators d floats apart) and the
// page's V rows of one KV head (`stride` elements apart). Two lanes and 32 floats of d at a time: eight
// accumulator registers held across all n rows, each V chunk loaded once for both lanes.
template <typename VT>
void add_weighted(float* acc, int64_t lanes, const float* w, int64_t ws, const VT* v, int64_t n, int64_t stride,
                  int64_t d) {
  for (int64_t l0 = 0; l0 < lanes; l0 += 2) {
    const int64_t l1 = std::min(l0 + 1, lanes - 1);  // an odd last lane pairs with itself; stored once
    const float *w0 = w + l0 * ws, *w1 = w + l1 * ws;
    float *a0 = acc + l0 * d, *a1 = acc + l1 * d;
    int64_t i0 = 0;
    for (; i0 + 4 * kVec <= d; i0 += 4 * kVec) {
      f32x8 x[4], y[4];
      for (int c = 0; c < 4; ++c) x[c] = load8(a0 + i0 + c * kVec), y[c] = load8(a1 + i0 + c * kVec);
      for (int64_t t = 0; t < n; ++t) {
        const VT* row = v + t * stride + i0;
        for (int c = 0; c < 4; ++c) {
          const f32x8 vc = load8(row + c * kVec);
          x[c] += w0[t] * vc;
          y[c] += w1[t] * vc;
        }
      }
      for (int c = 0; c < 4; ++c) store8(a1 + i0 + c * kVec, y[c]);
      for (int c = 0; c < 4; ++c) store8(a0 + i0 + c * kVec, x[c]);  // after a1's: a lane paired with itself
    }
    for (; i0 < d; i0 += kVec) {  // a head_dim that is not a multiple of 32
      f32x8 x = load8(a0 + i0), y = load8(a1 + i0);
      for (int64_t t = 0; t < n; ++t) {
        const f32x8 vc = load8(v + t * stride + i0);
        x += w0[t] * vc;
        y += w1[t] * vc;
      }
      store8(a1 + i0, y);
      store8(a0 + i0, x);
    }
  }
}

// Asks the memory system for n rows of d elements (`stride` apart) that will be read soon: the next page's rows
// of the KV head being worked on. Pages lie wherever the block table says, so the hardware prefetcher cannot
// guess the next one; without this every K and V row waits on a cache miss (perf: the kernel's time sat on the
// first load of each row).
template <typename T>
inline void prefetch_rows(const T* rows, int64_t n, int64_t stride, int64_t d) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per 64-byte cache line
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; i += kLine) __builtin_prefetch(rows + t * stride + i);
}

// Per-thread working memory, sized once for the largest item. Lane (h, r, j) of an item: its h-th KV head, tile
// row r, query head j of that head's group; a KV head's lanes are contiguous, so score_page sees one matrix.
struct Scratch {
  std::vector<float> q, acc, weights, row_max, row_sum;
  // >>> L12
  std::vector<float> scales;     // the scales of the current page's rows of one KV head
  // <<< L12
  std::vector<int64_t> visible;  // per tile row: keys of the current page it may see (0: none)
  int64_t ws;                    // floats per lane in `weights`: S rounded up to whole f32x8s

  Scratch(const Shape& sh, int64_t tile_rows) : ws((sh.s + kVec - 1) / kVec * kVec) {
    const int64_t lanes = tile_rows * sh.hq;
    q.resize(lanes * sh.d);
    acc.resize(lanes * sh.d);
    weights.resize(lanes * ws);
    row_max.resize(lanes);
    row_sum.resize(lanes);
    // >>> L12
    scales.resize(ws);
    // <<< L12
    visible.resize(tile_rows);
  }
};

// The micro-kernel's shape for a KV head's lanes: 2 lanes x 4 keys (a decode's GQA group of 2, a prefill
// tile's 16 lanes in eight blocks), each block's results stored as two runs of 4 scores; one lane (a group of 1
// decoding) 1 x 8.
template <typename T>
void score_head(const float* q, int64_t lanes, const T* k, int64_t n, int64_t stride, int64_t d, float* s,
                int64_t ws) {
  if (lanes >= 2)
    score_page<2, 4>(q, lanes, k, n, stride, d, s, ws);
  else
    score_page<1, 8>(q, lanes, k, n, stride, d, s, ws);
}

// T: q's and the output's dtype; KT: the pool's (T itself in L3).
template <typename T, typename KT>
void attend_item(const int64_t* item, const Shape& sh, const T* q, const KT* k_cache, const KT* v_cache,
                 const int32_t* pages, T* out, Scratch& w) {
  // >>> L12
  constexpr bool kInt8 = std::is_same_v<KT, int8_t>;
  // <<< L12
  const int64_t kv_begin = item[kChunk] * sh.hkv / item[kChunks];
  const int64_t kv_end = (item[kChunk] + 1) * sh.hkv / item[kChunks];
  const int64_t row_begin = item[kRowBegin], rows = item[kRowEnd] - row_begin, d = sh.d, g = sh.group;
  const int64_t head_lanes = rows * g;  // lanes of one KV head
  const int64_t lanes = (kv_end - kv_begin) * head_lanes;
  if (lanes == 0) return;  // more head chunks than KV heads: this one has none
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Lane (h, r, j) reads query head (kv_begin + h) * group + j of row row_begin + r.
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const int64_t h = lane / head_lanes, r = lane % head_lanes / g, j = lane % g;
    const T* src = q + ((row_begin + r) * sh.hq + (kv_begin + h) * g + j) * d;
    for (int64_t i = 0; i < d; i += kVec) store8(&w.q[lane * d + i], load8(src + i) * scale);
  }
  std::fill(w.acc.begin(), w.acc.begin() + lanes * d, 0.f);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + lanes, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + lanes, -std::numeric_limits<float>::infinity());

  // Causal, bottom-right aligned: the row at position first_pos + i sees keys 0 .. first_pos + i.
  const int64_t first_row = item[kFirstPos] + (row_begin - item[kRow0]);  // the tile's first row's position
  const int64_t tile_keys = first_row + rows;                             // what the tile's last row sees
  const int64_t token_size = sh.hkv * sh.row;                             // NHD: one token's K (or V) rows
  const int64_t ws = w.ws;
  for (int64_t p = 0; p * sh.s < tile_keys; ++p) {
    const int64_t page_start = p * sh.s, page_tokens = std::min(sh.s, tile_keys - page_start);
    const int64_t page_offset = static_cast<int64_t>(pages[p]) * sh.s * token_size;
    for (int64_t r = 0; r < rows; ++r)
      w.visible[r] = std::clamp<int64_t>(first_row + r + 1 - page_start, 0, page_tokens);
    const bool more = (p + 1) * sh.s < tile_keys;
    const int64_t next_offset = more ? static_cast<int64_t>(pages[p + 1]) * sh.s * token_size : 0;
    for (int64_t h = 0; h < kv_end - kv_begin; ++h) {
      const int64_t lane0 = h * head_lanes, head_offset = page_offset + (kv_begin + h) * sh.row;
      if (more) {
        prefetch_rows(k_cache + next_offset + (kv_begin + h) * sh.row, sh.s, token_size, sh.row);
        prefetch_rows(v_cache + next_offset + (kv_begin + h) * sh.row, sh.s, token_size, sh.row);
      }
      float* s = &w.weights[lane0 * ws];
      float* acc = &w.acc[lane0 * d];
      score_head(&w.q[lane0 * d], head_lanes, k_cache + head_offset, page_tokens, token_size, d, s, ws);
      // >>> L12
      if constexpr (kInt8) {  // q . (code x scale) = (q . code) x scale: one multiply per score
        row_scales(k_cache + head_offset, page_tokens, token_size, d, w.scales.data());
        scale_keys(s, head_lanes, ws, w.scales.data(), page_tokens);
      }
      // <<< L12
      for (int64_t r = 0, lane = 0; r < rows; ++r)
        for (int64_t j = 0; j < g; ++j, ++lane)
          softmax_page(s + lane * ws, w.visible[r], ws, w.row_max[lane0 + lane], w.row_sum[lane0 + lane],
                       acc + lane * d, d);
      // >>> L12
      if constexpr (kInt8) {  // weight x (code x scale) = (weight x scale) x code; the sums keep the bare weights
        row_scales(v_cache + head_offset, page_tokens, token_size, d, w.scales.data());
        scale_keys(s, head_lanes, ws, w.scales.data(), page_tokens);
      }
      // <<< L12
      add_weighted(acc, head_lanes, s, ws, v_cache + head_offset, page_tokens, token_size, d);
    }
  }

  for (int64_t lane = 0; lane < lanes; ++lane) {
    const int64_t h = lane / head_lanes, r = lane % head_lanes / g, j = lane % g;
    const float inv = 1.0f / w.row_sum[lane];  // never 0: every row sees at least its own key
    T* dst = out + ((row_begin + r) * sh.hq + (kv_begin + h) * g + j) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(w.acc[lane * d + i] * inv);
  }
}

}  // namespace

// The step's work items, as an int64 tensor [items, kItemFields]: each request's rows cut into tiles of at most
// tile_rows (kTileRows unless a caller asks for fewer), longest (most rows x keys) first, so threads that each
// take the next item finish together.
// Checks the page tables on the way, so a bad table is an error here. Called once per step; every layer's
// run_planned reuses the result. `threads`: the thread count the step will run with (torch's, by default).
at::Tensor plan(const at::Tensor& qo_indptr_in, const at::Tensor& kv_indptr_in, const at::Tensor& kv_indices_in,
                const at::Tensor& last_page_len_in, int64_t s, int64_t threads, int64_t tile_rows = kTileRows) {
  for (const at::Tensor* t : {&qo_indptr_in, &kv_indptr_in, &kv_indices_in, &last_page_len_in})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu() && t->dim() == 1,
                "page tables must be 1-D int32 CPU tensors");
  TORCH_CHECK(s >= 1, "block size must be at least 1, got ", s);
  TORCH_CHECK(tile_rows >= 1 && tile_rows <= kTileRows, "tile_rows must be 1 .. ", kTileRows, ", got ", tile_rows);
  const at::Tensor qo_indptr = qo_indptr_in.contiguous(), kv_indptr = kv_indptr_in.contiguous();
  const at::Tensor kv_indices = kv_indices_in.contiguous(), last_page_len = last_page_len_in.contiguous();
  const int64_t batch = last_page_len.numel();
  TORCH_CHECK(qo_indptr.numel() == batch + 1 && kv_indptr.numel() == batch + 1,
              "qo_indptr and kv_indptr need batch + 1 entries");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kv = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = last_page_len.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  TORCH_CHECK(qo[0] == 0, "qo_indptr must start at 0");
  TORCH_CHECK(kv[0] == 0 && kv[batch] <= kv_indices.numel(), "kv_indptr runs past kv_indices");
  std::vector<std::array<int64_t, kItemFields>> tiles;
  std::vector<int64_t> cost;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n_q = qo[b + 1] - qo[b], n_pages = kv[b + 1] - kv[b];
    TORCH_CHECK(n_pages >= 1 && last[b] >= 1 && last[b] <= s, "request ", b, ": ", n_pages,
                " page(s), last page length ", last[b], " (block size ", s, ")");
    const int64_t kv_len = s * (n_pages - 1) + last[b];
    TORCH_CHECK(n_q >= 1 && n_q <= kv_len, "request ", b, " feeds ", n_q, " row(s) over a history of ", kv_len);
    for (int64_t j = kv[b]; j < kv[b + 1]; ++j)
      TORCH_CHECK(idx[j] >= 0, "request ", b, " names block ", idx[j]);
    for (int64_t r = qo[b]; r < qo[b + 1]; r += tile_rows) {
      const int64_t end = std::min<int64_t>(r + tile_rows, qo[b + 1]);
      tiles.push_back({b, r, end, kv_len - n_q, qo[b], 0, 1});
      cost.push_back((end - r) * (kv_len - (qo[b + 1] - end)));  // rows x the keys its last row sees
    }
  }
  // Few tiles for the threads (one long decode; a prompt of a few tiles): split each tile's KV heads into
  // chunks, up to kItemsPerThread items a thread, so every thread gets work and none is left finishing a long
  // item alone. A chunk reads only its heads' K/V rows, so splitting adds no reads, only per-item work. The
  // plan does not know Hkv: past it (at most kMaxChunks) some chunks have no head, and return at once.
  constexpr int64_t kItemsPerThread = 8, kMaxChunks = 8;
  const int64_t n_tiles = std::max<int64_t>(tiles.size(), 1);
  const int64_t chunks = threads <= 1 ? 1 : std::clamp<int64_t>((kItemsPerThread * threads + n_tiles - 1) / n_tiles,
                                                                1, kMaxChunks);
  std::vector<int64_t> order(tiles.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  at::Tensor items = at::empty({static_cast<int64_t>(tiles.size()) * chunks, kItemFields}, at::kLong);
  int64_t* it = items.data_ptr<int64_t>();
  for (int64_t i : order)
    for (int64_t c = 0; c < chunks; ++c, it += kItemFields) {
      std::copy(tiles[i].begin(), tiles[i].end(), it);
      it[kChunk] = c, it[kChunks] = chunks;
    }
  return items;
}

// q [T, Hq, D]; k_cache, v_cache [N, S, Hkv, D] (this step's K/V already written; L12: or int8 pages
// [N, S, Hkv, D + 4]); the step's kv_indptr and kv_indices, and its plan's work items. Returns [T, Hq, D] in q's dtype; softmax and sums in fp32 whatever the
// storage. Checks every shape, that the work items stay inside q and inside their requests' pages, and that
// every page is a block of the pool: a bad plan or pool is an error, not a read outside memory.
at::Tensor run_planned(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& kv_indptr_in,
                       const at::Tensor& kv_indices_in, const at::Tensor& items_in) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q [T, Hq, D] and k_cache, v_cache [N, S, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  bool int8_pages = false;  // set in L12's block
  // >>> L12
  int8_pages = k_cache.scalar_type() == at::kChar;  // int8 codes, each row's scale after them
  // <<< L12
  TORCH_CHECK(int8_pages || q.scalar_type() == k_cache.scalar_type(),
              "q and the pool must share a dtype (or the pool be int8 pages)");
  // Every size is checked before the first division by one: a pool with no KV heads is an error, not a
  // division by zero that kills the process.
  const int64_t hq = q.size(1), hkv = k_cache.size(2), d = q.size(2), s = k_cache.size(1);
  TORCH_CHECK(hkv >= 1 && hq >= 1 && hq % hkv == 0, "Hq (", hq, ") must be a positive multiple of Hkv (", hkv, ")");
  int64_t row = d;  // a KV head's row in the pool
  // >>> L12
  if (int8_pages) row = d + kScaleBytes;
  // <<< L12
  TORCH_CHECK(k_cache.size(3) == row, "head_dim: q has ", d, ", so the pool's rows need ", row, " elements",
              int8_pages ? " (int8 codes and a 4-byte scale)" : "", ", it has ", k_cache.size(3));
  TORCH_CHECK(d >= kVec && d % kVec == 0, "head_dim must be a positive multiple of ", kVec, ", got ", d);
  TORCH_CHECK(s >= 1, "block size must be at least 1, got ", s);
  const Shape sh{hq, hkv, hq / hkv, d, s, row};
  TORCH_CHECK(items_in.scalar_type() == at::kLong && items_in.dim() == 2 && items_in.size(1) == kItemFields,
              "work items must be plan()'s int64 tensor [items, ", static_cast<int64_t>(kItemFields), "]");
  for (const at::Tensor* t : {&kv_indptr_in, &kv_indices_in})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), "page tables must be int32 CPU tensors");

  q = q.contiguous();
  k_cache = k_cache.contiguous();  // the pool is contiguous already: no copy
  v_cache = v_cache.contiguous();
  const at::Tensor kv_ptr = kv_indptr_in.contiguous(), kv_idx = kv_indices_in.contiguous();
  const at::Tensor items = items_in.contiguous();
  const int32_t* kv_start = kv_ptr.data_ptr<int32_t>();
  const int32_t* idx = kv_idx.data_ptr<int32_t>();
  const int64_t batch = kv_ptr.numel() - 1, n_items = items.size(0), num_blocks = k_cache.size(0);
  TORCH_CHECK(batch >= 0 && kv_start[0] == 0 && kv_start[batch] <= kv_idx.numel(), "kv_indptr runs past kv_indices");
  for (int64_t j = 0; j < kv_start[batch]; ++j)  // a few hundred ints per step: cheap next to the attention
    TORCH_CHECK(idx[j] >= 0 && idx[j] < num_blocks, "kv_indices names block ", idx[j], " of ", num_blocks);
  const int64_t* work = items.data_ptr<int64_t>();
  int64_t tile_rows = 1;  // the plan's largest tile, which sizes each thread's scratch
  for (int64_t i = 0; i < n_items; ++i) {
    const int64_t* it = work + i * kItemFields;
    const int64_t b = it[kRequest];
    tile_rows = std::max(tile_rows, it[kRowEnd] - it[kRowBegin]);
    TORCH_CHECK(b >= 0 && b < batch && 0 <= it[kRow0] && it[kRow0] <= it[kRowBegin] &&
                    it[kRowBegin] < it[kRowEnd] && it[kRowEnd] <= q.size(0) && it[kFirstPos] >= 0 &&
                    it[kFirstPos] + (it[kRowEnd] - it[kRow0]) <= s * (kv_start[b + 1] - kv_start[b]) &&
                    it[kRowEnd] - it[kRowBegin] <= kTileRows && 0 <= it[kChunk] && it[kChunk] < it[kChunks],
                "work item ", i, " does not fit this step's q and page tables: plan() the step that runs");
  }
  at::Tensor out = at::empty_like(q);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const auto attend_all = [&](const auto* kp, const auto* vp) {
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      // Each thread takes the next item until none are left: items differ in length (a 640-token history
      // against a 32-token one), and fixed shares would leave one thread idle while the other finishes.
      std::atomic<int64_t> next{0};
      const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n_items, 1));
      at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        Scratch scratch(sh, tile_rows);
        for (int64_t i; (i = next.fetch_add(1)) < n_items;) {
          const int64_t* it = work + i * kItemFields;
          attend_item(it, sh, qp, kp, vp, idx + kv_start[it[kRequest]], op, scratch);
        }
      });
    };
    // >>> L12
    if (int8_pages) return attend_all(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
    // <<< L12
    attend_all(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
  });
  return out;
}

// plan and run in one call: for one-off use (tests, a single layer); the engine plans once per step instead.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor qo_indptr,
                           at::Tensor kv_indptr, at::Tensor kv_indices, at::Tensor kv_last_page_len) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [T, Hq, D] and k_cache, v_cache [N, S, Hkv, D]");
  const at::Tensor items = plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, k_cache.size(1),
                                at::get_num_threads());
  TORCH_CHECK(qo_indptr.contiguous().data_ptr<int32_t>()[qo_indptr.numel() - 1] == q.size(0),
              "qo_indptr must run from 0 to the number of query rows");
  return run_planned(q, k_cache, v_cache, kv_indptr, kv_indices, items);
}

// exp8 over a float tensor, for the test that holds it to std::exp's accuracy.
at::Tensor vector_exp(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "vector_exp takes a float32 CPU tensor");
  const int64_t n = x_in.numel(), padded = (n + kVec - 1) / kVec * kVec;
  std::vector<float> buf(padded, 0.f);
  std::memcpy(buf.data(), x_in.contiguous().data_ptr<float>(), n * sizeof(float));
  for (int64_t i = 0; i < padded; i += kVec) store8(&buf[i], exp8(load8(&buf[i])));
  at::Tensor out = at::empty_like(x_in, at::MemoryFormat::Contiguous);
  std::memcpy(out.data_ptr<float>(), buf.data(), n * sizeof(float));
  return out;
}

// The calls release the GIL: they touch no Python object, and a long one (64 rows over a 32k history: most of
// a second) would otherwise stop every other Python thread, a server's event loop included. Arguments are
// converted before the release and the result after; an error reacquires the GIL and is raised as RuntimeError.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("plan", &plan, "a step's work items from its CSR page tables (checked here)", py::arg("qo_indptr"),
        py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("kv_last_page_len"), py::arg("block_size"),
        py::arg("threads"), py::arg("tile_rows") = kTileRows,
        py::call_guard<py::gil_scoped_release>());
  m.def("run_planned", &run_planned, "paged attention over a block-tensor pool, read in place, for planned items",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "plan and run_planned in one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("vector_exp", &vector_exp, "the kernel's exp of eight floats at once, elementwise over a tensor");
}
