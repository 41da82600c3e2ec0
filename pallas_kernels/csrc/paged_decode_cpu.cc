// Decode-only (Q == 1) paged attention for XLA:CPU, as an XLA FFI custom call.
//
// Reads K/V straight from the pool through the block table (no gather copy).
// One work item per (sequence b, kv head); the G query heads that share a KV
// head are computed together, so each K/V row is streamed from memory once.
// fp32 online softmax; K/V may be f32 or bf16 (converted on load), q/out f32
// or bf16.  Work items run on XLA's intra-op thread pool; the calling thread
// also claims items, so it never waits on a task that has not started.
//
// Semantics: see pallas_kernels.paged_attention (restricted to Q == 1).  Keys
// at positions >= the visible length are never loaded, so unowned blocks and
// the tail of the last block may hold anything (NaN included).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float load_f(float x) { return x; }
inline float load_f(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store_f(float* p, float x) { *p = x; }
inline void store_f(uint16_t* p, float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a quiet NaN
    *p = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 (x = -inf included -> 0), branch-free so loops over it
// vectorize: Cody-Waite range reduction + degree-6 polynomial, ~2 ulp.
inline float exp_neg(float x) {
  const bool tiny = !(x >= -87.0f);  // also true for NaN-free -inf
  x = tiny ? -87.0f : x;
  const float n = __builtin_roundevenf(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float pl = 1.9875691500e-4f;
  pl = pl * r + 1.3981999507e-3f;
  pl = pl * r + 8.3334519073e-3f;
  pl = pl * r + 4.1665795894e-2f;
  pl = pl * r + 1.6666665459e-1f;
  pl = pl * r + 5.0000001201e-1f;
  pl = pl * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? 0.0f : pl * scale;
}

struct Params {
  const void* q;
  const void* pool;
  const int32_t* bt;
  const int32_t* kv_lens;
  const int32_t* q_lens;
  void* out;
  int64_t B, H, D, NB, L, KVH, BS, W, G;
  int64_t layer;
  float scale;
};

// Converts n contiguous elements of type T to f32 (a no-op copy for f32).
template <typename T>
inline const float* as_f32(const T* src, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = load_f(src[i]);
  return buf;
}
template <>
inline const float* as_f32<float>(const float* src, int64_t, float*) {
  return src;
}

template <typename QT, typename KT>
void run_item(const Params& p, int64_t item, std::vector<float>& scratch) {
  const int64_t b = item / p.KVH, kvh = item % p.KVH;
  const int64_t G = p.G, D = p.D, BS = p.BS;
  QT* out = static_cast<QT*>(p.out) + (b * p.H + kvh * G) * D;

  const int64_t kv_len = std::min<int64_t>(p.kv_lens[b], p.W * BS);
  const int64_t q_len = p.q_lens[b];
  // The single query token sits at position kv_len - q_len; it sees keys
  // 0 .. kv_len - q_len (and only keys < kv_len).
  int64_t n_keys = std::min<int64_t>(kv_len, int64_t{p.kv_lens[b]} - q_len + 1);
  if (q_len <= 0 || n_keys <= 0) {
    for (int64_t i = 0; i < G * D; ++i) store_f(out + i, 0.0f);
    return;
  }

  // scratch layout: q [G*D] | acc [G*D] | scores [G*BS] | m [G] | l [G] | kbuf [D] | vbuf [D]
  scratch.resize(2 * G * D + G * BS + 2 * G + 2 * D);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* s = acc + G * D;
  float* m = s + G * BS;
  float* l = m + G;
  float* kbuf = l + G;
  float* vbuf = kbuf + D;

  const QT* q = static_cast<const QT*>(p.q) + (b * p.H + kvh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = load_f(q[i]) * p.scale;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -INFINITY);
  std::fill(l, l + G, 0.0f);

  const KT* pool = static_cast<const KT*>(p.pool);
  const int32_t* bt = p.bt + b * p.W;
  const int64_t head_stride = BS * D;                 // one (kv head) slab of a block
  const int64_t kv_stride = p.KVH * head_stride;      // K -> V
  const int64_t layer_stride = 2 * kv_stride;
  const int64_t block_stride = p.L * layer_stride;
  const int64_t n_blocks = (n_keys + BS - 1) / BS;

  for (int64_t j = 0; j < n_blocks; ++j) {
    int64_t phys = bt[j];
    phys = std::min<int64_t>(std::max<int64_t>(phys, 0), p.NB - 1);
    const int64_t n = std::min<int64_t>(BS, n_keys - j * BS);
    const KT* kblk = pool + phys * block_stride + p.layer * layer_stride + kvh * head_stride;
    const KT* vblk = kblk + kv_stride;
    if (j + 1 < n_blocks) {  // blocks are scattered: prefetch the next one's K/V rows
      int64_t nxt = std::min<int64_t>(std::max<int64_t>(bt[j + 1], 0), p.NB - 1);
      const int64_t nn = std::min<int64_t>(BS, n_keys - (j + 1) * BS);
      const char* kn = reinterpret_cast<const char*>(
          pool + nxt * block_stride + p.layer * layer_stride + kvh * head_stride);
      const int64_t bytes = nn * D * static_cast<int64_t>(sizeof(KT));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(kn + off);
        __builtin_prefetch(kn + kv_stride * sizeof(KT) + off);
      }
    }

    // Scores for the n valid keys of this block, all G heads.
    for (int64_t t = 0; t < n; ++t) {
      const float* k = as_f32<KT>(kblk + t * D, D, kbuf);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
        s[g * BS + t] = dot;
      }
    }
    // Online softmax update.
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      float bm = m[g];
      for (int64_t t = 0; t < n; ++t) bm = std::max(bm, sg[t]);
      const float corr = exp_neg(m[g] - bm);  // exp(-inf) = 0 on the first block
      m[g] = bm;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = exp_neg(sg[t] - bm);
        sum += sg[t];
      }
      l[g] = l[g] * corr + sum;
      float* ag = acc + g * D;
      if (corr != 1.0f) {
        for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* v = as_f32<KT>(vblk + t * D, D, vbuf);
      for (int64_t g = 0; g < G; ++g) {
        const float pw = s[g * BS + t];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += pw * v[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t d = 0; d < D; ++d) store_f(out + g * D + d, acc[g * D + d] * inv);
  }
}

using ItemFn = void (*)(const Params&, int64_t, std::vector<float>&);

struct Shared {
  Params p;
  ItemFn fn;
  int64_t n_items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

void work_loop(Shared& sh) {
  std::vector<float> scratch;
  for (;;) {
    const int64_t i = sh.next.fetch_add(1);
    if (i >= sh.n_items) break;
    sh.fn(sh.p, i, scratch);
  }
}

template <typename QT, typename KT>
ItemFn pick() {
  return &run_item<QT, KT>;
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool_threads, ffi::AnyBuffer q, ffi::AnyBuffer kv_pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
                           ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t max_threads) {
  auto qd = q.dimensions();
  auto pd = kv_pool.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 4 || qd[1] != 1)
    return ffi::Error::InvalidArgument("paged_decode_cpu: q must be [B, 1, H, D]");
  if (pd.size() != 6 || pd[2] != 2)
    return ffi::Error::InvalidArgument("paged_decode_cpu: kv_pool must be [NB, L, 2, KVH, BS, D]");
  if (bd.size() != 2 || bd[0] != qd[0])
    return ffi::Error::InvalidArgument("paged_decode_cpu: block_tables must be [B, W]");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("paged_decode_cpu: layer must be a scalar");
  if (kv_lens.element_count() != static_cast<size_t>(qd[0]) ||
      q_lens.element_count() != static_cast<size_t>(qd[0]))
    return ffi::Error::InvalidArgument("paged_decode_cpu: kv_lens / q_lens must be [B]");
  if (out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged_decode_cpu: output dtype must match q");

  Params p;
  p.B = qd[0];
  p.H = qd[2];
  p.D = qd[3];
  p.NB = pd[0];
  p.L = pd[1];
  p.KVH = pd[3];
  p.BS = pd[4];
  p.W = bd[1];
  if (pd[5] != p.D) return ffi::Error::InvalidArgument("paged_decode_cpu: head_dim mismatch");
  if (p.KVH <= 0 || p.H % p.KVH != 0)
    return ffi::Error::InvalidArgument("paged_decode_cpu: num_heads % num_kv_heads != 0");
  p.G = p.H / p.KVH;
  p.layer = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), std::max<int64_t>(p.L - 1, 0));
  p.scale = sm_scale;
  p.q = q.untyped_data();
  p.pool = kv_pool.untyped_data();
  p.bt = block_tables.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.q_lens = q_lens.typed_data();
  p.out = out->untyped_data();

  const int64_t n_items = p.B * p.KVH;
  if (n_items == 0 || p.D == 0) return ffi::Error::Success();
  if (p.NB == 0 || p.L == 0 || p.W == 0 || p.BS == 0) {
    // Nothing can be visible: zero output.
    std::memset(p.out, 0, out->size_bytes());
    return ffi::Error::Success();
  }

  const auto qt = q.element_type(), kt = kv_pool.element_type();
  ItemFn fn = nullptr;
  if (qt == ffi::DataType::F32 && kt == ffi::DataType::F32) fn = pick<float, float>();
  else if (qt == ffi::DataType::F32 && kt == ffi::DataType::BF16) fn = pick<float, uint16_t>();
  else if (qt == ffi::DataType::BF16 && kt == ffi::DataType::F32) fn = pick<uint16_t, float>();
  else if (qt == ffi::DataType::BF16 && kt == ffi::DataType::BF16) fn = pick<uint16_t, uint16_t>();
  else return ffi::Error::InvalidArgument("paged_decode_cpu: q and kv_pool must be f32 or bf16");

  int64_t threads = pool_threads.num_threads();
  if (threads <= 0) threads = 1;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  threads = std::min(threads, hw);
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::min(threads, n_items);

  auto sh = std::make_shared<Shared>();
  sh->p = p;
  sh->fn = fn;
  sh->n_items = n_items;
  for (int64_t t = 1; t < threads; ++t) {
    pool_threads.Schedule([sh]() {
      sh->active.fetch_add(1);
      work_loop(*sh);
      sh->active.fetch_sub(1);
    });
  }
  work_loop(*sh);
  // Every item is claimed now; wait for workers still computing theirs.  A
  // worker increments `active` before it claims an item, so once the caller
  // has seen the queue exhausted, active == 0 means all items are done.
  while (sh->active.load() != 0) std::this_thread::yield();
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// K/V write, in place: pool[slot / BS, layer, kv, h, slot % BS, :] = new_kv[t, kv, h, :]
// for every new token t with slot = slots[t] (slots outside the pool are
// dropped).  XLA:CPU lowers a scatter into a bf16 buffer by converting the
// whole buffer to f32 and back (~1 s for a 1.5 GB pool); this touches only
// the rows written.  The result aliases the pool operand.

template <typename PT, typename KT>
void write_rows(void* pool, const void* new_kv, const int32_t* slots, int64_t T, int64_t NB,
                int64_t L, int64_t KVH, int64_t BS, int64_t D, int64_t layer) {
  PT* dst_pool = static_cast<PT*>(pool);
  const KT* src = static_cast<const KT*>(new_kv);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= NB * BS) continue;
    const int64_t blk = slot / BS, off = slot % BS;
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t h = 0; h < KVH; ++h) {
        PT* dst = dst_pool + ((((blk * L + layer) * 2 + kv) * KVH + h) * BS + off) * D;
        const KT* row = src + ((t * 2 + kv) * KVH + h) * D;
        for (int64_t i = 0; i < D; ++i) store_f(dst + i, load_f(row[i]));
      }
    }
  }
}

ffi::Error WriteKvImpl(ffi::AnyBuffer pool, ffi::AnyBuffer new_kv, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  auto kd = new_kv.dimensions();
  if (pd.size() != 6 || pd[2] != 2)
    return ffi::Error::InvalidArgument("write_kv_cpu: kv_pool must be [NB, L, 2, KVH, BS, D]");
  if (kd.size() != 4 || kd[1] != 2 || kd[2] != pd[3] || kd[3] != pd[5])
    return ffi::Error::InvalidArgument("write_kv_cpu: new_kv must be [T, 2, KVH, D] matching the pool");
  if (slots.element_count() != static_cast<size_t>(kd[0]))
    return ffi::Error::InvalidArgument("write_kv_cpu: slots must be [T]");
  if (layer.element_count() != 1 || layer.typed_data()[0] < 0 || layer.typed_data()[0] >= pd[1])
    return ffi::Error::InvalidArgument("write_kv_cpu: layer out of range");
  if (out->element_type() != pool.element_type() || out->size_bytes() != pool.size_bytes())
    return ffi::Error::InvalidArgument("write_kv_cpu: output must match the pool");
  if (out->untyped_data() != pool.untyped_data())  // XLA did not alias: copy, then write
    std::memcpy(out->untyped_data(), pool.untyped_data(), pool.size_bytes());
  const auto pt = pool.element_type(), kt = new_kv.element_type();
  const bool p32 = pt == ffi::DataType::F32, k32 = kt == ffi::DataType::F32;
  if ((!p32 && pt != ffi::DataType::BF16) || (!k32 && kt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("write_kv_cpu: pool and new_kv must be f32 or bf16");
  auto fn = p32 ? (k32 ? write_rows<float, float> : write_rows<float, uint16_t>)
                : (k32 ? write_rows<uint16_t, float> : write_rows<uint16_t, uint16_t>);
  fn(out->untyped_data(), new_kv.untyped_data(), slots.typed_data(), kd[0], pd[0], pd[1], pd[3],
     pd[4], pd[5], layer.typed_data()[0]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedDecodeCpu, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::AnyBuffer>()       // kv_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Ret<ffi::AnyBuffer>()       // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedWriteKvCpu, WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // kv_pool (aliased to the result)
                                  .Arg<ffi::AnyBuffer>()         // new_kv [T, 2, KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Ret<ffi::AnyBuffer>());       // kv_pool
