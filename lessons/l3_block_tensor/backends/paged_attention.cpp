// Paged attention on the CPU: every request's new tokens attend over K/V read in place from the pages its
// block table names. Nothing is gathered into a padded copy first; this is what FlashInfer's kernels do on
// a GPU, and it takes exactly their inputs: the CSR page tables (qo_indptr, kv_indptr, kv_indices,
// kv_last_page_len) and one layer's NHD pool [num_blocks, S, Hkv, D].
//
// The loop nest. A work item is one request b, a tile of up to kTileRows of its query rows and its KV heads
// (all of them, unless there are more threads than tiles: then a range). A lane is one (query row, query
// head) pair of the item: a decode row has Hq lanes, a prefill tile up to kTileRows times as many.
//
//   for each page p of b                            block id kv_indices[kv_indptr[b] + p]
//     read its K rows [S, Hkv, D] once              one contiguous block of the pool
//     for each lane: scores against its KV head     a GQA group's query heads share that head's rows;
//                                                   keys past the lane's causal limit are not scored
//                    online-softmax update          rescale the lane's sum and accumulator if its max grew
//     read its V rows [S, Hkv, D] once
//     for each lane: accumulator += weights * V
//   output = accumulator / sum, per lane
//
// Work items are independent, so they run in parallel over torch's intra-op threads (one thread: in order),
// over requests and row tiles, and over KV heads when there are fewer tiles than threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTileRows = 8;  // query rows of one request that share each page read (prefills, slices)

struct Shape {
  int64_t hq, hkv, group, d, s;  // query heads, KV heads, query heads per KV head, head dim, block size
};

struct Tile {
  int64_t request;
  int64_t row_begin, row_end;  // rows of the flat query stream, all of one request
  int64_t first_pos;           // position of the request's first new row: kv_len - (rows it feeds)
  int64_t row0;                // the request's first row in the stream (qo_indptr[request])
  int64_t kv_begin, kv_end;    // the KV heads this work item attends with, and so their query heads
};

// One page [S, Hkv, D] as fp32. An fp32 pool is read where it lies. A bf16 or fp16 page is widened into
// `buf` once, and every lane then reads the fp32 copy: the conversion is paid once per page, not per head.
template <typename T>
const float* read_page(const T* page, int64_t tokens, int64_t token_size, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return page;
  } else {
    for (int64_t i = 0; i < tokens * token_size; ++i) buf[i] = static_cast<float>(page[i]);
    return buf.data();
  }
}

// Eight floats as one value. GCC and Clang put it in the machine's SIMD registers (AVX, AVX-512, NEON) or,
// without any, in plain scalar code: the vector loops below are portable, and fast where the CPU allows.
typedef float f32x8 __attribute__((vector_size(32)));
constexpr int64_t kVec = 8;  // floats in one f32x8

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

inline float sum8(f32x8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Scores of q against n key rows (`stride` floats apart), four rows at a time: four independent sums keep the
// multiply-add units busy, where a single dot product waits on its own previous add at every step.
inline void scores(const float* q, const float* rows, int64_t n, int64_t stride, int64_t d, float* out) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *k0 = rows + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    f32x8 s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int64_t i = 0; i < d; i += kVec) {
      const f32x8 qi = load8(q + i);
      s0 += qi * load8(k0 + i);
      s1 += qi * load8(k1 + i);
      s2 += qi * load8(k2 + i);
      s3 += qi * load8(k3 + i);
    }
    out[t] = sum8(s0), out[t + 1] = sum8(s1), out[t + 2] = sum8(s2), out[t + 3] = sum8(s3);
  }
  for (; t < n; ++t) {
    const float* k = rows + t * stride;
    f32x8 sum = {};
    for (int64_t i = 0; i < d; i += kVec) sum += load8(q + i) * load8(k + i);
    out[t] = sum8(sum);
  }
}

inline void scale_by(float* x, float c, int64_t d) {
  for (int64_t i = 0; i < d; i += kVec) store8(x + i, load8(x + i) * c);
}

// acc += sum over t < n of weights[t] * row t (rows `stride` floats apart), 64 floats of acc at a time held in
// eight registers across all n rows: updating acc in memory once per row would chain each row behind a store.
inline void add_weighted(float* acc, const float* weights, const float* rows, int64_t n, int64_t stride, int64_t d) {
  int64_t i0 = 0;
  for (; i0 + 8 * kVec <= d; i0 += 8 * kVec) {
    f32x8 a[8];
    for (int c = 0; c < 8; ++c) a[c] = load8(acc + i0 + c * kVec);
    for (int64_t t = 0; t < n; ++t) {
      const float* row = rows + t * stride + i0;
      for (int c = 0; c < 8; ++c) a[c] += weights[t] * load8(row + c * kVec);
    }
    for (int c = 0; c < 8; ++c) store8(acc + i0 + c * kVec, a[c]);
  }
  for (; i0 < d; i0 += kVec) {  // a head_dim that is not a multiple of 64
    f32x8 a = load8(acc + i0);
    for (int64_t t = 0; t < n; ++t) a += weights[t] * load8(rows + t * stride + i0);
    store8(acc + i0, a);
  }
}

// Per-thread working memory, sized once for the largest tile.
struct Scratch {
  std::vector<float> q, acc, weights, row_max, row_sum, k_buf, v_buf;
  std::vector<int64_t> visible;  // per tile row: keys of the current page it may see (0: none)

  explicit Scratch(const Shape& sh) {
    const int64_t lanes = kTileRows * sh.hq;
    q.resize(lanes * sh.d);
    acc.resize(lanes * sh.d);
    weights.resize(lanes * sh.s);
    row_max.resize(lanes);
    row_sum.resize(lanes);
    visible.resize(kTileRows);
    k_buf.resize(sh.s * sh.hkv * sh.d);
    v_buf.resize(sh.s * sh.hkv * sh.d);
  }
};

template <typename T>
void attend_tile(const Tile& tile, const Shape& sh, const T* q, const T* k_cache, const T* v_cache,
                 const int32_t* pages, T* out, Scratch& w) {
  const int64_t heads = (tile.kv_end - tile.kv_begin) * sh.group;  // query heads of the item's KV heads
  const int64_t rows = tile.row_end - tile.row_begin, lanes = rows * heads, d = sh.d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Lane r * heads + j: row tile.row_begin + r, query head h0 + j, which reads KV head (h0 + j) / group:
  // query heads are grouped by KV head in order.
  const int64_t h0 = tile.kv_begin * sh.group;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + ((tile.row_begin + r) * sh.hq + h0) * d;  // the row's heads h0 .. h0 + heads - 1
    for (int64_t i = 0; i < heads * d; ++i) w.q[r * heads * d + i] = static_cast<float>(src[i]) * scale;
  }
  std::fill(w.acc.begin(), w.acc.begin() + lanes * d, 0.f);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + lanes, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + lanes, -std::numeric_limits<float>::infinity());

  // Causal, bottom-right aligned: the row at position first_pos + i sees keys 0 .. first_pos + i.
  const int64_t tile_keys = tile.first_pos + (tile.row_end - tile.row0);  // what the tile's last row sees
  const int64_t token_size = sh.hkv * d;                                 // NHD: one token's K (or V) rows
  for (int64_t p = 0; p * sh.s < tile_keys; ++p) {
    const int64_t page_start = p * sh.s, page_tokens = std::min(sh.s, tile_keys - page_start);
    const int64_t page_offset = static_cast<int64_t>(pages[p]) * sh.s * token_size;
    const float* k = read_page(k_cache + page_offset, page_tokens, token_size, w.k_buf);

    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row_keys = tile.first_pos + (tile.row_begin + r - tile.row0) + 1;
      const int64_t n = w.visible[r] = std::clamp<int64_t>(row_keys - page_start, 0, page_tokens);
      if (n == 0) continue;  // an early prefill row: this whole page is in its future
      for (int64_t j = 0; j < heads; ++j) {
        const int64_t lane = r * heads + j;
        const float* k_head = k + ((h0 + j) / sh.group) * d;  // token t's row of the lane's KV head: + t * token_size
        float* s = &w.weights[lane * sh.s];
        scores(&w.q[lane * d], k_head, n, token_size, d, s);
        const float page_max = *std::max_element(s, s + n);
        // Online softmax: weights so far were exp(score - old max). A larger max shrinks them all by
        // exp(old max - new max); the sum and the accumulator are rescaled once, here, not per key.
        float& m = w.row_max[lane];
        if (page_max > m) {
          const float shrink = std::exp(m - page_max);  // 0 on the lane's first page (m = -inf, sum = acc = 0)
          w.row_sum[lane] *= shrink;
          scale_by(&w.acc[lane * d], shrink, d);
          m = page_max;
        }
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - m);
          w.row_sum[lane] += s[t];
        }
      }
    }

    const float* v = read_page(v_cache + page_offset, page_tokens, token_size, w.v_buf);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < heads; ++j) {
        const int64_t lane = r * heads + j;
        add_weighted(&w.acc[lane * d], &w.weights[lane * sh.s], v + ((h0 + j) / sh.group) * d, w.visible[r],
                     token_size, d);
      }
  }

  for (int64_t lane = 0; lane < lanes; ++lane) {
    const float inv = 1.0f / w.row_sum[lane];  // never 0: every row sees at least its own key
    T* dst = out + ((tile.row_begin + lane / heads) * sh.hq + h0 + lane % heads) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(w.acc[lane * d + i] * inv);
  }
}

// The step's work items: each request's rows cut into tiles of at most kTileRows. Checks the page tables on
// the way, so a bad table is an error here, not a read outside the pool.
std::vector<Tile> make_tiles(const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                             const at::Tensor& last_page_len, int64_t s, int64_t hkv, int64_t num_blocks,
                             int64_t num_rows) {
  const int64_t batch = last_page_len.numel();
  TORCH_CHECK(qo_indptr.numel() == batch + 1 && kv_indptr.numel() == batch + 1,
              "qo_indptr and kv_indptr need batch + 1 entries");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kv = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = last_page_len.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  TORCH_CHECK(qo[0] == 0 && qo[batch] == num_rows, "qo_indptr must run from 0 to the number of query rows");
  TORCH_CHECK(kv[0] == 0 && kv[batch] <= kv_indices.numel(), "kv_indptr runs past kv_indices");
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n_q = qo[b + 1] - qo[b], n_pages = kv[b + 1] - kv[b];
    TORCH_CHECK(n_pages >= 1 && last[b] >= 1 && last[b] <= s, "request ", b, ": ", n_pages,
                " page(s), last page length ", last[b], " (block size ", s, ")");
    const int64_t kv_len = s * (n_pages - 1) + last[b];
    TORCH_CHECK(n_q >= 1 && n_q <= kv_len, "request ", b, " feeds ", n_q, " row(s) over a history of ", kv_len);
    for (int64_t j = kv[b]; j < kv[b + 1]; ++j)
      TORCH_CHECK(idx[j] >= 0 && idx[j] < num_blocks, "request ", b, " names block ", idx[j], " of ", num_blocks);
    for (int64_t r = qo[b]; r < qo[b + 1]; r += kTileRows)
      tiles.push_back({b, r, std::min<int64_t>(r + kTileRows, qo[b + 1]), kv_len - n_q, qo[b], 0, 0});
  }
  // Fewer tiles than threads (one long decode, say): split each tile's KV heads into chunks, so every thread
  // gets work. With enough tiles, or one thread, an item keeps all heads and reads each page once.
  const int64_t chunks = std::clamp<int64_t>(at::get_num_threads() / std::max<int64_t>(tiles.size(), 1), 1, hkv);
  std::vector<Tile> items;
  for (const Tile& t : tiles)
    for (int64_t c = 0; c < chunks; ++c) {
      items.push_back(t);
      items.back().kv_begin = c * hkv / chunks;
      items.back().kv_end = (c + 1) * hkv / chunks;
    }
  return items;
}

}  // namespace

// q [T, Hq, D]; k_cache, v_cache [N, S, Hkv, D] (this step's K/V already written); the CSR tables as int32
// CPU tensors. Returns [T, Hq, D] in q's dtype; softmax and sums in fp32 whatever the storage.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor qo_indptr,
                           at::Tensor kv_indptr, at::Tensor kv_indices, at::Tensor kv_last_page_len) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q [T, Hq, D] and k_cache, v_cache [N, S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  for (const at::Tensor* t : {&qo_indptr, &kv_indptr, &kv_indices, &kv_last_page_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), "page tables must be int32 CPU tensors");
  // Every size is checked before the first division by one: a pool with no KV heads is an error, not a
  // division by zero that kills the process.
  const int64_t hq = q.size(1), hkv = k_cache.size(2), d = q.size(2), s = k_cache.size(1);
  TORCH_CHECK(hkv >= 1 && hq >= 1 && hq % hkv == 0, "Hq (", hq, ") must be a positive multiple of Hkv (", hkv, ")");
  TORCH_CHECK(k_cache.size(3) == d, "head_dim: q has ", d, ", the pool ", k_cache.size(3));
  TORCH_CHECK(d >= kVec && d % kVec == 0, "head_dim must be a positive multiple of ", kVec, ", got ", d);
  TORCH_CHECK(s >= 1, "block size must be at least 1, got ", s);
  const Shape sh{hq, hkv, hq / hkv, d, s};

  q = q.contiguous();
  k_cache = k_cache.contiguous();  // the pool is contiguous already: no copy
  v_cache = v_cache.contiguous();
  const at::Tensor kv_ptr = kv_indptr.contiguous(), kv_idx = kv_indices.contiguous();
  const std::vector<Tile> tiles = make_tiles(qo_indptr.contiguous(), kv_ptr, kv_idx, kv_last_page_len.contiguous(),
                                             sh.s, sh.hkv, k_cache.size(0), q.size(0));
  const int32_t* kv_start = kv_ptr.data_ptr<int32_t>();
  at::Tensor out = at::empty_like(q);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int32_t* idx = kv_idx.data_ptr<int32_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(sh);
      for (int64_t i = begin; i < end; ++i)
        attend_tile<scalar_t>(tiles[i], sh, qp, kp, vp, idx + kv_start[tiles[i].request], op, scratch);
    });
  });
  return out;
}

// The call releases the GIL: it touches no Python object, and a long one (64 rows over a 32k history: most of
// a second) would otherwise stop every other Python thread, a server's event loop included. Its arguments are
// converted before the release and its result after; an error reacquires the GIL and is raised as RuntimeError.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block-tensor pool, read in place",
        py::call_guard<py::gil_scoped_release>());
}
