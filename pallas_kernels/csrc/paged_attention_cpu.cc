// Ragged paged attention, the in-place K/V write, the batch-invariant matmul
// and the skinny matmul of decode steps for XLA:CPU, as XLA FFI custom calls.  Attention semantics: see
// pallas_kernels.paged_attention (attributes window and soft_cap: 0 = none,
// else the sliding window and the logit cap; token_tile: tokens per work item).
//
// Attention.  One kernel for decode tokens and prefill chunks alike.  A work
// item is (sequence, kv head, tile of that sequence's new tokens); its rows
// are the tile's tokens x the G query heads of the kv head (row r is token
// r / G, head r % G), so every K/V row read serves all of them.  An item walks
// the keys 0 (with a sliding window: its first token's window start) .. (last
// visible key of its last token) in chunks of kChunk keys and runs an fp32
// online softmax.  K/V rows are read straight from the pool
// through the block table (one pointer per key row; bf16 rows, and V rows when
// head_dim is not a multiple of 8, go through a chunk-sized fp32 copy, and so
// do quantized rows -- int8 or float8_e4m3fn values and a power-of-two scale
// per row -- dequantized exactly on the way) -- never a padded gather of the
// sequence -- and the next chunk's rows are prefetched.
// Per chunk:
//
//   S^T[key][row] = K . Q^T      register-blocked micro-kernel, kQkKeys keys
//                                broadcast x kQkVecs*8 rows vectorized
//   soft cap (if any): S = c * tanh(S / c) with c = soft_cap * log2(e), in
//   fp32 with std::tanh
//   sliding-window mask (only in the chunks before the tile's last token's
//   window start) and causal mask (only in the chunks past the tile's first
//   token); running max, sum and exp2 with a polynomial, vectorized over rows
//   O[row][:] = corr[row] * O[row][:] + P . V
//                                register-blocked micro-kernel, kPvRows rows
//                                broadcast x kPvVecs*8 head-dim lanes
//
// Q^T is built once per item (scaled by sm_scale * log2(e), so the softmax
// works in base 2), so neither product needs a transposed K.  Items of at most
// kDotRows rows (decode with G <= 4) compute S^T as dot products over the head
// dim instead (qk_dot), which keeps their lanes busy.  Keys at
// positions >= the sequence's kv_len (or past every row's causal limit, or
// past the block table) are never loaded, nor (with a sliding window) keys
// before the item's first token's window start pos - window + 1, so unowned
// blocks, the null block, the tail of a last block and the blocks before the
// window may hold anything (NaN included).  Items are ordered by decreasing
// cost and claimed dynamically by the calling thread and XLA's intra-op
// thread pool; each item is computed by one thread, so the
// result does not depend on the thread count.
//
// K/V write.  pool[blocks[t], layer, {K,V}, h, offsets[t], :] = {k,v}[t, h, :]
// in place (the result aliases the pool operand); writes with a block, offset
// or layer out of range are dropped, as in the reference's scatter.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------
// 8-lane fp32 vectors (GCC vector extensions: AVX/AVX2 ymm with -march=native
// on x86, pairs of 128-bit registers elsewhere).

constexpr int kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(32)));

inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf vbcast(float x) { return vf{x, x, x, x, x, x, x, x}; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }  // NaN a -> b

// 2^x for x <= 0 (x = -inf included -> 0, and x < -127 -> 0): round to
// nearest, degree-6 polynomial of 2^r on [-0.5, 0.5] (rel. error ~2e-7),
// 2^n through the exponent bits; branch-free.  n = -127 gives exponent bits 0,
// i.e. exactly 0, so no select is needed for the underflow (nor for NaN).
inline vf vexp2_neg(vf x) {
  x = vmax(x, vbcast(-127.0f));
  const vf magic = vbcast(12582912.0f);  // 1.5 * 2^23: adding it rounds to nearest
  const vf n = (x + magic) - magic;
  const vf r = x - n;
  vf pl = vbcast(1.535336188319500e-4f);
  pl = pl * r + vbcast(1.339887440266574e-3f);
  pl = pl * r + vbcast(9.618437357674640e-3f);
  pl = pl * r + vbcast(5.550332471162809e-2f);
  pl = pl * r + vbcast(2.402264791363012e-1f);
  pl = pl * r + vbcast(6.931472028550421e-1f);
  pl = pl * r + vbcast(1.0f);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return pl * (vf)bits;  // a vector cast reinterprets the bits
}

inline float load_f(float x) { return x; }
inline float load_f(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store_f(float* p, float x) { *p = x; }
inline void store_f(uint16_t* p, float x) {  // round to nearest even; branch-free (vectorizes)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  *p = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// n contiguous elements to fp32.
inline void to_f32(const float* src, int64_t n, float* dst) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void to_f32(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_f(src[i]);
}

// 8 consecutive elements as fp32.
inline vf vload8(const float* p) { return vload(p); }
inline vf vload8(const uint16_t* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = load_f(p[i]);
  return v;
}

// ---------------------------------------------------------------------------
// Quantized pages (pallas_kernels.reference: quantize_pages / read_pages): a
// page of one (layer, K/V, kv head) is [BS + 1, D], BS rows of head_dim values
// of one byte, then one row whose first BS elements are those rows' scale
// codes c, integers stored as numbers of the pool's dtype; a row means
// values * scale(c), with
// scale(c) = 2^c for fp8 (c in [-16, 16]) and 2^(c/4) for int8 (c in [-64, 64]),
// the latter as 2^floor(c/4) * kQuarterPowers[c mod 4] (reference.row_scale).
// The element types: int8_t (int8), Fp8 (float8_e4m3fn bits).  Rows are
// dequantized to fp32 while a chunk is staged, so every micro-kernel below
// runs unchanged on them; 2^e is built from exponent bits, so dequantization
// is exact.

// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no inf; NaN is S.1111.111.
struct Fp8 {
  uint8_t bits;
};
static_assert(sizeof(Fp8) == 1, "a pool of Fp8 is addressed by bytes");

template <typename KT>
constexpr bool kQuantized = std::is_same_v<KT, int8_t> || std::is_same_v<KT, Fp8>;

// 2^e for an integer e in [-126, 127]: the exponent bits of a normal float (exact).
inline float pow2i(int32_t e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 2^(k/4) in fp32, k = 0..3: reference.QUARTER_POWERS, bit for bit.
constexpr float kQuarterPowers[4] = {0x1p+0f, 0x1.306fep+0f, 0x1.6a09e6p+0f, 0x1.ae89fap+0f};

// An int8 row's scale: 2^(c/4) = 2^floor(c/4) * 2^((c mod 4)/4) (arithmetic shift
// and two's-complement mask: floor and a non-negative remainder for negative c).
inline float int8_scale(int32_t c) { return pow2i(c >> 2) * kQuarterPowers[c & 3]; }

// Every float8_e4m3fn value as fp32 (exact), for scalar reads: the exponent
// column and the head-dim tail past the last multiple of 8.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int x = 0; x < 256; ++x) {
      const int e = (x >> 3) & 15, m = x & 7;
      const float mag = (x & 0x7f) == 0x7f ? NAN
                        : e == 0           ? std::ldexp(static_cast<float>(m), -9)  // subnormal
                                           : std::ldexp(static_cast<float>(8 + m), e - 10);
      v[x] = x & 0x80 ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

inline float elem_f(int8_t x) { return x; }
inline float elem_f(Fp8 x) { return kFp8.v[x.bits]; }

// A row's scale exponent from its code (element `off` of its page's code row).  Codes of the contract hold an
// integer in [-64, 64] (int8) or [-16, 16] (fp8); only the poisoned rows a sequence does not own hold
// anything else (int8 127, fp8 NaN), and the kernel never loads those.  The
// clamp to [-100, 100] keeps every power of two built from it (below) a
// normal float.
constexpr int32_t kExpClamp = 100;
template <typename KT>
inline int32_t row_exponent(KT code) {
  const float e = elem_f(code);
  return e >= -kExpClamp && e <= kExpClamp ? static_cast<int32_t>(e) : kExpClamp;  // NaN too
}

// Quantized row (D values, its code apart) -> D fp32 values, dequantized: value * 2^e.
//
// int8: sign-extend to int32, convert, scale (vpmovsxbd + vcvtdq2ps + vmulps).
// GCC 12 builds __builtin_convertvector from 8-byte vectors one element at a
// time (scalar loads and inserts, several times slower), hence the intrinsics.
//
// float8_e4m3fn (S.EEEE.MMM, bias 7): the byte sign-extended to 16 bits and
// shifted left by 7 is the binary16 S.0EEEE.MMM0000000 (bit 14, the copy of
// the sign, cleared), whose value is the fp8 value * 2^-8 -- subnormals
// included, since binary16's exponent bias (15) is 8 more than fp8's and its
// subnormals are the same shape.  vcvtph2ps converts that exactly (MXCSR's
// DAZ does not apply to it), and 2^(e + 8) scales it back and applies the
// row's scale in one multiply.  fp8 NaN (|x| = 0x7f) would come out as 480:
// it is made a binary16 NaN first.  Measured here (one core, 64-value rows in
// L1): int8 ~4 ns a row, fp8 ~7.5 (~2 of them the NaN fix), the exact fp8
// formula below ~12, a 256-entry table read with vpgatherdd ~25.  Without
// AVX2 + F16C, that formula from the bit fields: |x| = mant * 2^(max(E, 1) - 10),
// mant = M + 8 for normals and M for subnormals, with the row's exponent in
// the same power of two.
template <typename KT>
inline void dequant_row(const KT* src, KT code, int64_t D, float* dst) {
  const int32_t e = row_exponent(code);
  float scale;
  if constexpr (std::is_same_v<KT, int8_t>) {
    scale = int8_scale(e);
  } else {
    scale = pow2i(e);
  }
  int64_t d = 0;
  if constexpr (std::is_same_v<KT, int8_t>) {
    const vf vscale = vbcast(scale);
    for (; d + kLanes <= D; d += kLanes) {
#if defined(__AVX2__)
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
      const vi x = (vi)_mm256_cvtepi8_epi32(b);
#else
      vi x;
      for (int i = 0; i < kLanes; ++i) x[i] = src[d + i];
#endif
      vstore(dst + d, __builtin_convertvector(x, vf) * vscale);
    }
  } else {
#if defined(__AVX2__) && defined(__F16C__)
    const vf vscale = vbcast(pow2i(e + 8));
    const __m128i clear14 = _mm_set1_epi16(static_cast<int16_t>(0xbfff));
    const __m128i abs_mask = _mm_set1_epi16(0x7fff), nan_in = _mm_set1_epi16(0x3f80),
                  nan_exp = _mm_set1_epi16(0x7c00);
    for (; d + kLanes <= D; d += kLanes) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&src[d].bits));
      __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), clear14);
      const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, abs_mask), nan_in);
      h = _mm_or_si128(h, _mm_and_si128(nan, nan_exp));
      vstore(dst + d, (vf)_mm256_cvtph_ps(h) * vscale);
    }
#else
    for (; d + kLanes <= D; d += kLanes) {
      vi x;
      for (int i = 0; i < kLanes; ++i) x[i] = src[d + i].bits;
      const vi ex = (x >> 3) & 15, m = x & 7;
      const vi mant = m | ((ex != 0) & 8);
      const vi pw = ((ex > 1 ? ex : 1) + (117 + e)) << 23;  // 117 = 127 (bias) - 10
      const vi bits = (vi)(__builtin_convertvector(mant, vf) * (vf)pw) | ((x & 0x80) << 24);
      vstore(dst + d, (vf)((x & 0x7f) == 0x7f ? vi{} + 0x7fc00000 : bits));
    }
#endif
  }
  for (; d < D; ++d) dst[d] = elem_f(src[d]) * scale;
}

// In-register 8x8 transpose: r[i][j] -> r[j][i].
inline void transpose8(vf r[8]) {
  const vi lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
  const vi lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  vf t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], lo);
    t[2 * i + 1] = __builtin_shuffle(r[2 * i], r[2 * i + 1], hi);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = __builtin_shuffle(t[4 * i], t[4 * i + 2], lo2);
    u[4 * i + 1] = __builtin_shuffle(t[4 * i], t[4 * i + 2], hi2);
    u[4 * i + 2] = __builtin_shuffle(t[4 * i + 1], t[4 * i + 3], lo2);
    u[4 * i + 3] = __builtin_shuffle(t[4 * i + 1], t[4 * i + 3], hi2);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = __builtin_shuffle(u[i], u[i + 4], lo4);
    r[i + 4] = __builtin_shuffle(u[i], u[i + 4], hi4);
  }
}

// ---------------------------------------------------------------------------
// Micro-kernel: C[MR x NV*8] (=, or = cscale[i] * C +) A . B over k < K, with
// A(i, k) broadcast and B(k, :) loaded as NV vectors; MR * NV accumulators
// live in registers.  Operands are addressed through small policies so that
// K/V rows can come straight from the pool (a pointer per row).

struct StridedA {  // A(i, k) = p[i * sa + k * sk]
  const float* p;
  int64_t sa, sk;
  float get(int i, int64_t k) const { return p[i * sa + k * sk]; }
  StridedA rows_from(int64_t i) const { return {p + i * sa, sa, sk}; }
};
struct RowsA {  // A(i, k) = rows[i][k]
  const float* const* rows;
  float get(int i, int64_t k) const { return rows[i][k]; }
  RowsA rows_from(int64_t i) const { return {rows + i}; }
};
struct StridedB {  // B(k, j) = p[k * ld + j]
  const float* p;
  int64_t ld;
  const float* row(int64_t k) const { return p + k * ld; }
  StridedB cols_from(int64_t j) const { return {p + j, ld}; }
};
struct RowsB {  // B(k, j) = rows[k][off + j]
  const float* const* rows;
  int64_t off;
  const float* row(int64_t k) const { return rows[k] + off; }
  RowsB cols_from(int64_t j) const { return {rows, off + j}; }
};

template <int MR, int NV, bool ACC, class AOp, class BOp>
inline void micro(float* __restrict C, int64_t ldc, AOp a, BOp b, int64_t K,
                  const float* __restrict cscale) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    const vf c = ACC ? vbcast(cscale[i]) : vbcast(0.0f);
    for (int j = 0; j < NV; ++j) acc[i][j] = ACC ? vload(C + i * ldc + j * kLanes) * c : c;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* brow = b.row(k);
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = vload(brow + j * kLanes);
    for (int i = 0; i < MR; ++i) {
      const vf ai = vbcast(a.get(i, k));
      for (int j = 0; j < NV; ++j) acc[i][j] += ai * bv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) vstore(C + i * ldc + j * kLanes, acc[i][j]);
}

// Rows i < rem (rem <= N) of one column panel, in one N-row tile at most.
template <int N, int NV, bool ACC, class AOp, class BOp>
inline void micro_tail(int64_t rem, float* C, int64_t ldc, AOp a, BOp b, int64_t K,
                       const float* cscale) {
  if constexpr (N >= 1) {
    if (rem == N) {
      micro<N, NV, ACC>(C, ldc, a, b, K, cscale);
      return;
    }
    micro_tail<N - 1, NV, ACC>(rem, C, ldc, a, b, K, cscale);
  }
}

// C[M x NV*8] for any M, in MR-row register tiles plus one smaller tail tile.
template <int MR, int NV, bool ACC, class AOp, class BOp>
inline void gemm_cols(float* C, int64_t ldc, AOp a, BOp b, int64_t K, const float* cscale,
                      int64_t M) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR)
    micro<MR, NV, ACC>(C + i * ldc, ldc, a.rows_from(i), b, K, cscale + (ACC ? i : 0));
  if (i < M)
    micro_tail<MR - 1, NV, ACC>(M - i, C + i * ldc, ldc, a.rows_from(i), b, K,
                                cscale + (ACC ? i : 0));
}

// Column panels j < remv (remv <= NV) in one panel of remv vectors.
template <int MR, int NV, bool ACC, class AOp, class BOp>
inline void cols_tail(int64_t remv, float* C, int64_t ldc, AOp a, BOp b, int64_t K,
                      const float* cscale, int64_t M) {
  if constexpr (NV >= 1) {
    if (remv == NV) {
      gemm_cols<MR, NV, ACC>(C, ldc, a, b, K, cscale, M);
      return;
    }
    cols_tail<MR, NV - 1, ACC>(remv, C, ldc, a, b, K, cscale, M);
  }
}

// C[M x N] (N a multiple of 8) = A . B (or cscale * C + A . B), NV-vector panels.
template <int MR, int NV, bool ACC, class AOp, class BOp>
void gemm(float* C, int64_t ldc, AOp a, BOp b, int64_t K, const float* cscale, int64_t M,
          int64_t N) {
  const int64_t nv = N / kLanes;
  int64_t j = 0;
  for (; j + NV <= nv; j += NV)
    gemm_cols<MR, NV, ACC>(C + j * kLanes, ldc, a, b.cols_from(j * kLanes), K, cscale, M);
  if (j < nv)
    cols_tail<MR, NV - 1, ACC>(nv - j, C + j * kLanes, ldc, a, b.cols_from(j * kLanes), K,
                               cscale, M);
}

// Register tiles (12 accumulators + 2 B vectors + 1 broadcast of 16 ymm
// registers): QK is 6 keys x 16 rows, PV 6 rows x 16 head-dim lanes.  Items of
// 48 rows (16 tokens x G = 3) and chunks of 48 keys keep an item's working set
// (Q^T, S^T, O: 3 x 12 KB at D = 64) near L1.
constexpr int kQkKeys = 6, kQkVecs = 2;
constexpr int kPvRows = 6, kPvVecs = 2;
constexpr int64_t kChunk = 48;     // keys per online-softmax step
constexpr int64_t kTileRows = 48;  // target rows (tokens x G) per work item
constexpr float kLog2e = 1.44269504088896341f;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Params {
  const void* q;
  const void* pool;
  const int32_t* bt;
  const int32_t* kv_lens;
  void* out;
  int64_t T, H, D, Dp, NB, L, KVH, BS, W, G, S;
  int64_t Pr;  // rows per page: BS, + 1 (the scale codes) when quantized
  int64_t layer;
  int64_t tile_tokens, max_rows_p;
  float scale;  // sm_scale * log2(e): scores are kept in base-2 units
  int64_t window;  // sliding window (keys pos - window + 1 .. pos); 0: none
  float cap;       // soft_cap * log2(e) (the cap in base-2 units); 0: none
};

struct Item {
  int32_t seq, kvh;
  int64_t q_start;  // flat index of the sequence's first new token
  int64_t q_len, kv_len;
  int64_t tok0, ntok;  // this tile: the sequence's new tokens tok0 .. tok0 + ntok - 1
  double cost;
};

constexpr int64_t kChunkP = (kChunk + kQkKeys - 1) / kQkKeys * kQkKeys;

// Per-thread buffers, sized for the largest item.
struct Scratch {
  std::unique_ptr<float[]> mem;
  float *qt, *st, *kb, *vb, *o, *m, *l, *corr, *lim, *lo, *zero;
  const float* krow[kChunkP];  // K row of each key of the chunk (padding keys: zero)
  const float* vrow[kChunkP];  // V row of each key of the chunk
  void init(const Params& p) {
    const int64_t Rp = p.max_rows_p, D = p.D, Dp = p.Dp;
    const int64_t sizes[] = {D * Rp, kChunkP * Rp, kChunkP * D, kChunkP * Dp, Rp * Dp,
                             Rp, Rp, Rp, Rp, Rp, Dp};
    constexpr int n = sizeof(sizes) / sizeof(sizes[0]);
    int64_t total = 0;
    for (int64_t s : sizes) total += round_up(s, 16) + 16;
    mem.reset(new float[total + 16]());  // zeroed: vb's padding columns, the zero row
    float* base = mem.get();
    base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 16) % 16;  // 64-byte align
    float** ptrs[n] = {&qt, &st, &kb, &vb, &o, &m, &l, &corr, &lim, &lo, &zero};
    for (int i = 0; i < n; ++i) {
      *ptrs[i] = base;
      base += round_up(sizes[i], 16) + 16;
    }
  }
};

// Row pointers of keys [k0, k0 + nk) of (sequence, kv head) into sc.krow /
// sc.vrow, block by block through the block table: straight into the pool
// for fp32 (V rows too when D is a multiple of 8), else through fp32 copies
// (bf16 converted, quantized rows dequantized).
template <typename KT>
void chunk_rows(const Params& p, const int32_t* bt, int64_t kvh, int64_t k0, int64_t nk,
                Scratch& sc) {
  constexpr bool f32 = std::is_same_v<KT, float>;
  const KT* pool = static_cast<const KT*>(p.pool);
  const int64_t D = p.D, Dp = p.Dp;
  const int64_t head_stride = p.Pr * D;
  const int64_t kv_stride = p.KVH * head_stride;
  const int64_t block_stride = p.L * 2 * kv_stride;
  const int64_t base = p.layer * 2 * kv_stride + kvh * head_stride;
  const bool v_direct = f32 && Dp == D;
  for (int64_t k = k0; k < k0 + nk;) {
    const int64_t j = k / p.BS, off = k % p.BS;
    const int64_t n = std::min(p.BS - off, k0 + nk - k);
    const int64_t phys = std::min<int64_t>(std::max<int64_t>(bt[j], 0), p.NB - 1);
    const KT* ksrc = pool + phys * block_stride + base + off * D;
    const KT* vsrc = ksrc + kv_stride;
    const KT* kcode = ksrc + (p.BS - off) * D + off;  // the page's code row, from element off
    const KT* vcode = kcode + kv_stride;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t idx = k - k0 + t;
      if constexpr (f32) {
        sc.krow[idx] = reinterpret_cast<const float*>(ksrc + t * D);
      } else if constexpr (kQuantized<KT>) {
        dequant_row(ksrc + t * D, kcode[t], D, sc.kb + idx * D);
        sc.krow[idx] = sc.kb + idx * D;
      } else {
        to_f32(ksrc + t * D, D, sc.kb + idx * D);
        sc.krow[idx] = sc.kb + idx * D;
      }
      if (v_direct) {
        sc.vrow[idx] = reinterpret_cast<const float*>(vsrc + t * D);
      } else {
        if constexpr (kQuantized<KT>)
          dequant_row(vsrc + t * D, vcode[t], D, sc.vb + idx * Dp);
        else
          to_f32(vsrc + t * D, D, sc.vb + idx * Dp);
        sc.vrow[idx] = sc.vb + idx * Dp;
      }
    }
    k += n;
  }
  for (int64_t idx = nk; idx < round_up(nk, kQkKeys); ++idx) sc.krow[idx] = sc.zero;
}

// Prefetch the K and V rows of keys [k0, k0 + nk): a chunk's blocks are
// scattered over the pool, which defeats the hardware prefetcher (decode is
// bound by memory latency without this).
template <typename KT>
void prefetch_chunk(const Params& p, const int32_t* bt, int64_t kvh, int64_t k0, int64_t nk) {
  const char* pool = static_cast<const char*>(p.pool);
  const int64_t row = p.D * static_cast<int64_t>(sizeof(KT));
  const int64_t head_stride = p.Pr * row;
  const int64_t kv_stride = p.KVH * head_stride;
  const int64_t block_stride = p.L * 2 * kv_stride;
  const int64_t base = p.layer * 2 * kv_stride + kvh * head_stride;
  for (int64_t k = k0; k < k0 + nk;) {
    const int64_t j = k / p.BS, off = k % p.BS;
    const int64_t n = std::min(p.BS - off, k0 + nk - k);
    const int64_t phys = std::min<int64_t>(std::max<int64_t>(bt[j], 0), p.NB - 1);
    const char* ksrc = pool + phys * block_stride + base + off * row;
    for (int64_t b = 0; b < n * row; b += 64) {
      __builtin_prefetch(ksrc + b, 0, 1);
      __builtin_prefetch(ksrc + kv_stride + b, 0, 1);
    }
    if constexpr (kQuantized<KT>) {  // the codes of these rows: one line of the code row
      const char* codes = ksrc + (p.BS - off) * row + off * static_cast<int64_t>(sizeof(KT));
      __builtin_prefetch(codes, 0, 1);
      __builtin_prefetch(codes + kv_stride, 0, 1);
    }
    k += n;
  }
}

// Q^T [D x Rp] of an item's rows, scaled; rows >= R are zero.
template <typename QT>
void load_qt(const Params& p, const Item& it, int64_t R, int64_t Rp, float* qt) {
  const int64_t G = p.G, D = p.D;
  const QT* q = static_cast<const QT*>(p.q);
  auto q_row = [&](int64_t r) {
    return q + ((it.q_start + it.tok0 + r / G) * p.H + it.kvh * G + r % G) * D;
  };
  const vf scale = vbcast(p.scale);
  if (D % kLanes == 0) {
    for (int64_t r0 = 0; r0 < Rp; r0 += kLanes) {
      const QT* rows[kLanes];
      for (int i = 0; i < kLanes; ++i) rows[i] = r0 + i < R ? q_row(r0 + i) : nullptr;
      for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
        vf blk[kLanes];
        for (int i = 0; i < kLanes; ++i)
          blk[i] = rows[i] ? vload8(rows[i] + d0) * scale : vbcast(0.0f);
        transpose8(blk);
        for (int i = 0; i < kLanes; ++i) vstore(qt + (d0 + i) * Rp + r0, blk[i]);
      }
    }
    return;
  }
  for (int64_t r = 0; r < Rp; ++r) {
    const QT* qr = r < R ? q_row(r) : nullptr;
    for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = qr ? load_f(qr[d]) * p.scale : 0.0f;
  }
}

inline float hsum(vf v) {
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

// S^T[n][r] = K[n] . Q[r] for n < nk and R <= 4 rows (decode: the G query heads
// of one token), as dot products vectorized over the head dim (D a multiple
// of 8; q [R x D] row-major, scaled): with so few rows, vectorizing over rows
// would leave most lanes idle.  Two keys at a time share each q load.
template <int R>
void qk_dot(float* st, int64_t Rp, const float* const* krow, int64_t nk, const float* q,
            int64_t D) {
  int64_t n = 0;
  for (; n + 2 <= nk; n += 2) {
    const float *k0 = krow[n], *k1 = krow[n + 1];
    vf a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = vbcast(0.0f);
    for (int64_t d = 0; d < D; d += kLanes) {
      const vf x0 = vload(k0 + d), x1 = vload(k1 + d);
      for (int r = 0; r < R; ++r) {
        const vf qv = vload(q + r * D + d);
        a0[r] += x0 * qv;
        a1[r] += x1 * qv;
      }
    }
    for (int r = 0; r < R; ++r) {
      st[n * Rp + r] = hsum(a0[r]);
      st[(n + 1) * Rp + r] = hsum(a1[r]);
    }
  }
  if (n < nk) {
    vf a0[R];
    for (int r = 0; r < R; ++r) a0[r] = vbcast(0.0f);
    for (int64_t d = 0; d < D; d += kLanes) {
      const vf x0 = vload(krow[n] + d);
      for (int r = 0; r < R; ++r) a0[r] += x0 * vload(q + r * D + d);
    }
    for (int r = 0; r < R; ++r) st[n * Rp + r] = hsum(a0[r]);
  }
}
using QkDotFn = void (*)(float*, int64_t, const float* const*, int64_t, const float*, int64_t);
constexpr QkDotFn kQkDot[5] = {nullptr, qk_dot<1>, qk_dot<2>, qk_dot<3>, qk_dot<4>};
constexpr int64_t kDotRows = 4;  // at most this many rows: qk_dot

// q [R x D] of an item's rows, scaled, row-major (for qk_dot).
template <typename QT>
void load_q_rows(const Params& p, const Item& it, int64_t R, float* qr) {
  const QT* q = static_cast<const QT*>(p.q);
  for (int64_t r = 0; r < R; ++r) {
    const QT* src = q + ((it.q_start + it.tok0 + r / p.G) * p.H + it.kvh * p.G + r % p.G) * p.D;
    for (int64_t d = 0; d < p.D; ++d) qr[r * p.D + d] = load_f(src[d]) * p.scale;
  }
}

// One chunk's causal mask and online-softmax step over S^T [nk x Rp] (in
// place: P^T = 2^(S^T - max)), vectorized over rows; m, l: running max and
// sum per row; corr: the factor for O.  Keys from mask_from on are masked
// against each row's limit lim.  NV > 0: that many row vectors, kept in
// registers over a sweep of the keys; NV == 0: any count, one vector at a time.
template <int NV>
void softmax_chunk(float* st, int64_t Rp, int64_t nvr, int64_t nk, int64_t k0, int64_t mask_from,
                   const float* lim, float* m, float* l, float* corr) {
  if constexpr (NV == 0) {
    for (int64_t n = mask_from; n < nk; ++n) {
      const vf key = vbcast(static_cast<float>(k0 + n));
      for (int64_t j = 0; j < nvr; ++j) {
        const vf s = vload(st + n * Rp + j * kLanes);
        vstore(st + n * Rp + j * kLanes, key < vload(lim + j * kLanes) ? s : vbcast(-INFINITY));
      }
    }
    for (int64_t j = 0; j < nvr; ++j) {
      float* sj = st + j * kLanes;
      const vf m_old = vload(m + j * kLanes);
      vf mx = m_old;
      for (int64_t n = 0; n < nk; ++n) mx = vmax(mx, vload(sj + n * Rp));
      vf sum = vbcast(0.0f);
      for (int64_t n = 0; n < nk; ++n) {
        const vf e = vexp2_neg(vload(sj + n * Rp) - mx);
        vstore(sj + n * Rp, e);
        sum += e;
      }
      const vf c = vexp2_neg(m_old - mx);  // 0 on the first chunk (m_old = -inf)
      vstore(corr + j * kLanes, c);
      vstore(m + j * kLanes, mx);
      vstore(l + j * kLanes, vload(l + j * kLanes) * c + sum);
    }
  } else {
    vf mx[NV], sum[NV];
    for (int j = 0; j < NV; ++j) mx[j] = vload(m + j * kLanes);
    for (int64_t n = 0; n < std::min(mask_from, nk); ++n)
      for (int j = 0; j < NV; ++j) mx[j] = vmax(mx[j], vload(st + n * Rp + j * kLanes));
    if (mask_from < nk) {
      vf lv[NV];
      for (int j = 0; j < NV; ++j) lv[j] = vload(lim + j * kLanes);
      for (int64_t n = mask_from; n < nk; ++n) {
        const vf key = vbcast(static_cast<float>(k0 + n));
        for (int j = 0; j < NV; ++j) {
          const vf s = key < lv[j] ? vload(st + n * Rp + j * kLanes) : vbcast(-INFINITY);
          vstore(st + n * Rp + j * kLanes, s);
          mx[j] = vmax(mx[j], s);
        }
      }
    }
    for (int j = 0; j < NV; ++j) sum[j] = vbcast(0.0f);
    for (int64_t n = 0; n < nk; ++n) {
      for (int j = 0; j < NV; ++j) {
        const vf e = vexp2_neg(vload(st + n * Rp + j * kLanes) - mx[j]);
        vstore(st + n * Rp + j * kLanes, e);
        sum[j] += e;
      }
    }
    for (int j = 0; j < NV; ++j) {
      const vf c = vexp2_neg(vload(m + j * kLanes) - mx[j]);  // 0 on the first chunk
      vstore(corr + j * kLanes, c);
      vstore(m + j * kLanes, mx[j]);
      vstore(l + j * kLanes, vload(l + j * kLanes) * c + sum[j]);
    }
  }
}
using SoftmaxFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                           float*, float*, float*);
constexpr int64_t kSoftmaxVecs = 6;
constexpr SoftmaxFn kSoftmax[kSoftmaxVecs + 1] = {
    softmax_chunk<0>, softmax_chunk<1>, softmax_chunk<2>, softmax_chunk<3>,
    softmax_chunk<4>, softmax_chunk<5>, softmax_chunk<6>};

// Soft cap of the first nk keys' scores, in place: S = c * tanh(S / c) (c:
// the cap in base-2 units, like S).  Padding lanes hold finite values (0).
void soft_cap_chunk(float* st, int64_t Rp, int64_t nk, float c) {
  const float inv = 1.0f / c;
  for (int64_t i = 0; i < nk * Rp; ++i) st[i] = c * std::tanh(st[i] * inv);
}

// Sliding-window mask of keys k0 .. k0 + nmask - 1 (those before some row's
// window start): S^T[n][r] = -inf where key k0 + n < lo[r].
void window_mask_chunk(float* st, int64_t Rp, int64_t nvr, int64_t nmask, int64_t k0,
                       const float* lo) {
  for (int64_t n = 0; n < nmask; ++n) {
    const vf key = vbcast(static_cast<float>(k0 + n));
    for (int64_t j = 0; j < nvr; ++j) {
      const vf s = vload(st + n * Rp + j * kLanes);
      vstore(st + n * Rp + j * kLanes, key < vload(lo + j * kLanes) ? vbcast(-INFINITY) : s);
    }
  }
}

template <typename QT, typename KT>
void run_item(const Params& p, const Item& it, Scratch& sc) {
  const int64_t G = p.G, D = p.D, Dp = p.Dp;
  const int64_t R = it.ntok * G, Rp = round_up(R, kLanes);
  const int64_t key_cap = p.W * p.BS;
  const int64_t first_pos = it.kv_len - it.q_len;  // position of the sequence's new token 0
  const int32_t* bt = p.bt + static_cast<int64_t>(it.seq) * p.W;

  // Keys visible to each row: 0 .. lim - 1.  Rows that see nothing (only
  // possible for malformed lengths) and the padding rows of the last vector
  // run unmasked and are written as zeros / dropped.
  int64_t kmax = 0, kmin = INT64_MAX;
  for (int64_t i = 0; i < it.ntok; ++i) {
    const int64_t lim = std::min(first_pos + it.tok0 + i + 1, key_cap);
    if (lim > 0) {
      kmax = std::max(kmax, lim);
      kmin = std::min(kmin, lim);
    }
  }
  float* lim = sc.lim;
  for (int64_t r = 0; r < Rp; ++r) {
    const int64_t l = r < R ? std::min(first_pos + it.tok0 + r / G + 1, key_cap) : 0;
    lim[r] = static_cast<float>(l > 0 ? l : kmax);
  }
  // Sliding window: row r sees keys lo[r] .. lim[r] - 1, lo[r] = its position
  // - window + 1.  The key loop starts at the first token's window start
  // (kstart, the smallest lo); keys below the largest lo (lo_max) are masked.
  // Rows that see nothing and the padding rows get lo = kstart (no mask).
  int64_t kstart = 0, lo_max = 0;
  if (p.window > 0) {
    kstart = std::max<int64_t>(0, first_pos + it.tok0 - p.window + 1);
    for (int64_t r = 0; r < Rp; ++r) {
      int64_t lo = kstart;
      if (r < R && first_pos + it.tok0 + r / G >= 0)
        lo = std::max<int64_t>(0, first_pos + it.tok0 + r / G - p.window + 1);
      sc.lo[r] = static_cast<float>(lo);
      lo_max = std::max(lo_max, lo);
    }
  }

  QT* out = static_cast<QT*>(p.out);
  auto out_row = [&](int64_t r) {
    return out + ((it.q_start + it.tok0 + r / G) * p.H + it.kvh * G + r % G) * D;
  };
  if (kmax == 0) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) store_f(out_row(r) + d, 0.0f);
    return;
  }
  // The output rows (G heads of a token are contiguous) are written at the
  // end: fetch their lines while the item computes.
  for (int64_t i = 0; i < it.ntok; ++i) {
    const char* row = reinterpret_cast<const char*>(out_row(i * G));
    for (int64_t b = 0; b < G * D * static_cast<int64_t>(sizeof(QT)); b += 64)
      __builtin_prefetch(row + b, 1, 2);
  }

  float *qt = sc.qt, *o = sc.o, *m = sc.m, *l = sc.l, *corr = sc.corr, *st = sc.st;
  const bool dot = R <= kDotRows && D % kLanes == 0;
  if (dot) {
    load_q_rows<QT>(p, it, R, qt);
    // Lanes of the padding rows are never written by qk_dot: keep them finite.
    std::fill(st, st + kChunkP * Rp, 0.0f);
  } else {
    load_qt<QT>(p, it, R, Rp, qt);
  }
  std::fill(o, o + R * Dp, 0.0f);
  std::fill(m, m + Rp, -INFINITY);
  std::fill(l, l + Rp, 0.0f);
  const int64_t nvr = Rp / kLanes;

  for (int64_t k0 = kstart; k0 < kmax; k0 += kChunk) {
    const int64_t nk = std::min(kChunk, kmax - k0);
    chunk_rows<KT>(p, bt, it.kvh, k0, nk, sc);
    if (k0 + nk < kmax)
      prefetch_chunk<KT>(p, bt, it.kvh, k0 + nk, std::min(kChunk, kmax - k0 - nk));

    // S^T [nk x Rp] = K . Q^T  (scaled scores, base-2 units)
    if (dot)
      kQkDot[R](st, Rp, sc.krow, nk, qt, D);
    else
      gemm<kQkKeys, kQkVecs, false>(st, Rp, RowsA{sc.krow}, StridedB{qt, Rp}, D, nullptr,
                                    round_up(nk, kQkKeys), Rp);

    if (p.cap > 0) soft_cap_chunk(st, Rp, nk, p.cap);
    if (k0 < lo_max) window_mask_chunk(st, Rp, nvr, std::min(nk, lo_max - k0), k0, sc.lo);
    // Causal mask (only from the first key past some row's limit), online
    // softmax; S^T becomes P^T in place.
    kSoftmax[nvr <= kSoftmaxVecs ? nvr : 0](st, Rp, nvr, nk, k0, std::max<int64_t>(0, kmin - k0),
                                            lim, m, l, corr);
    // O = corr * O + P . V   (P(row, key) = S^T[key][row])
    gemm<kPvRows, kPvVecs, true>(o, Dp, StridedA{st, 1, Rp}, RowsB{sc.vrow, 0}, nk, corr, R,
                                 Dp);
  }

  for (int64_t r = 0; r < R; ++r) {
    QT* dst = out_row(r);
    const int64_t rl = std::min(first_pos + it.tok0 + r / G + 1, key_cap);
    if (rl <= 0) {
      for (int64_t d = 0; d < D; ++d) store_f(dst + d, 0.0f);
      continue;
    }
    const float inv = 1.0f / l[r];
    const float* orow = o + r * Dp;
    for (int64_t d = 0; d < D; ++d) store_f(dst + d, orow[d] * inv);
  }
}

using ItemFn = void (*)(const Params&, const Item&, Scratch&);

// run_item for q of type QT and a pool of (checked) dtype kt.
template <typename QT>
ItemFn item_fn(ffi::DataType kt) {
  switch (kt) {
    case ffi::DataType::F32: return &run_item<QT, float>;
    case ffi::DataType::BF16: return &run_item<QT, uint16_t>;
    case ffi::DataType::S8: return &run_item<QT, int8_t>;
    default: return &run_item<QT, Fp8>;  // F8E4M3FN
  }
}

struct Shared {
  Params p;
  ItemFn fn;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

void work_loop(Shared& sh) {
  Scratch sc;
  bool ready = false;
  const int64_t n = static_cast<int64_t>(sh.items.size());
  for (;;) {
    const int64_t i = sh.next.fetch_add(1);
    if (i >= n) break;
    if (!ready) {
      sc.init(sh.p);
      ready = true;
    }
    sh.fn(sh.p, sh.items[i], sc);
  }
}

template <typename QT>
void zero_tokens(void* out, int64_t t0, int64_t t1, int64_t row) {
  if (t1 > t0) std::memset(static_cast<QT*>(out) + t0 * row, 0, (t1 - t0) * row * sizeof(QT));
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool_threads, ffi::AnyBuffer q,
                              ffi::AnyBuffer kv_pool, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> cu_q_lens, ffi::Result<ffi::AnyBuffer> out,
                              float sm_scale, int64_t max_threads, int64_t window,
                              float soft_cap, int64_t token_tile) {
  auto qd = q.dimensions();
  auto pd = kv_pool.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 3)
    return ffi::Error::InvalidArgument("paged_attention_cpu: q must be [T, H, D]");
  if (pd.size() != 6 || pd[2] != 2)
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: kv_pool must be [NB, L, 2, KVH, BS, D]");
  if (bd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention_cpu: block_tables must be [S, W]");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("paged_attention_cpu: layer must be a scalar");
  if (kv_lens.element_count() != static_cast<size_t>(bd[0]) ||
      cu_q_lens.element_count() != static_cast<size_t>(bd[0] + 1))
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: kv_lens must be [S], cu_q_lens [S + 1]");
  if (out->element_type() != q.element_type() || out->element_count() != q.element_count())
    return ffi::Error::InvalidArgument("paged_attention_cpu: output must match q");

  Params p;
  p.T = qd[0];
  p.H = qd[1];
  p.D = qd[2];
  p.Dp = round_up(p.D, kLanes);
  p.NB = pd[0];
  p.L = pd[1];
  p.KVH = pd[3];
  p.Pr = pd[4];
  p.S = bd[0];
  p.W = bd[1];
  const auto qt = q.element_type(), kt = kv_pool.element_type();
  const bool q32 = qt == ffi::DataType::F32;
  const bool quant = kt == ffi::DataType::S8 || kt == ffi::DataType::F8E4M3FN;
  if (!q32 && qt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("paged_attention_cpu: q must be f32 or bf16");
  if (!quant && kt != ffi::DataType::F32 && kt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: kv_pool must be f32, bf16, int8 or float8_e4m3fn");
  p.BS = p.Pr - (quant ? 1 : 0);  // a quantized page ends with its row of scale codes
  if (pd[5] != p.D)
    return ffi::Error::InvalidArgument("paged_attention_cpu: head_dim mismatch");
  if (quant && (p.BS < 1 || p.BS > p.D))
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: a quantized pool's pages are [block_size + 1, head_dim] with "
        "1 <= block_size <= head_dim");
  if (p.KVH <= 0 || p.H % p.KVH != 0)
    return ffi::Error::InvalidArgument("paged_attention_cpu: num_heads % num_kv_heads != 0");
  p.G = p.H / p.KVH;
  p.layer = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0),
                              std::max<int64_t>(p.L - 1, 0));
  p.scale = sm_scale * kLog2e;
  if (window < 0 || !(soft_cap >= 0.0f) || std::isinf(soft_cap))
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: window must be >= 0 and soft_cap finite and >= 0 (0: none)");
  p.window = window;
  p.cap = soft_cap * kLog2e;
  p.q = q.untyped_data();
  p.pool = kv_pool.untyped_data();
  p.bt = block_tables.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.out = out->untyped_data();
  // token_tile 1 (jpaged's batch_invariant mode) makes every item one token: a
  // query's arithmetic is then the same whatever tokens share its step.
  p.tile_tokens = token_tile > 0 ? token_tile : std::max<int64_t>(1, kTileRows / p.G);
  p.max_rows_p = round_up(p.tile_tokens * p.G, kLanes);

  if (p.T == 0 || p.H == 0 || p.D == 0) return ffi::Error::Success();
  const int64_t row = p.H * p.D;
  auto zero = q32 ? zero_tokens<float> : zero_tokens<uint16_t>;
  if (p.NB == 0 || p.L == 0 || p.W == 0 || p.BS == 0) {  // nothing can be visible
    zero(p.out, 0, p.T, row);
    return ffi::Error::Success();
  }

  // Work items; tokens no item covers are zeroed here.
  auto sh = std::make_shared<Shared>();
  const int32_t* cu = cu_q_lens.typed_data();
  int64_t covered = 0;  // tokens [0, covered) are owned by a sequence seen so far
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t start = std::min<int64_t>(std::max<int64_t>(cu[s], covered), p.T);
    const int64_t end = std::min<int64_t>(std::max<int64_t>(cu[s + 1], start), p.T);
    zero(p.out, covered, start, row);  // gap (malformed cu_q_lens)
    covered = std::max(covered, end);
    const int64_t q_len = end - start, kv_len = p.kv_lens[s];
    if (q_len <= 0) continue;
    if (kv_len <= 0) {
      zero(p.out, start, end, row);
      continue;
    }
    const int64_t full_q_len = static_cast<int64_t>(cu[s + 1]) - cu[s];  // positions use it
    for (int64_t t0 = 0; t0 < q_len; t0 += p.tile_tokens) {
      Item it;
      it.seq = static_cast<int32_t>(s);
      it.q_start = start;
      it.q_len = full_q_len;
      it.kv_len = kv_len;
      it.tok0 = t0;
      it.ntok = std::min(p.tile_tokens, q_len - t0);
      const int64_t key_end = std::min(kv_len - full_q_len + t0 + it.ntok, p.W * p.BS);
      const int64_t key_start =
          window > 0 ? std::max<int64_t>(0, kv_len - full_q_len + t0 - window + 1) : 0;
      const double keys = static_cast<double>(std::max<int64_t>(0, key_end - key_start));
      it.cost = (static_cast<double>(round_up(it.ntok * p.G, kLanes)) + 8.0) * (keys + 16.0);
      for (int64_t h = 0; h < p.KVH; ++h) {
        it.kvh = static_cast<int32_t>(h);
        sh->items.push_back(it);
      }
    }
  }
  zero(p.out, covered, p.T, row);  // padding tokens
  if (sh->items.empty()) return ffi::Error::Success();
  std::stable_sort(sh->items.begin(), sh->items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });

  sh->fn = q32 ? item_fn<float>(kt) : item_fn<uint16_t>(kt);
  sh->p = p;

  const int64_t n_items = static_cast<int64_t>(sh->items.size());
  int64_t threads = pool_threads.num_threads();
  if (threads <= 0) threads = 1;
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  threads = std::min(threads, hw);
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::min(threads, n_items);
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
// Batch-invariant matmul (jpaged's batch_invariant mode): C[M, N] = A[M, K] .
// B[K, N] in fp32, every element accumulated as acc = 0, acc = fma(A[i][k],
// B[k][j], acc) for k = 0 .. K - 1 in order (explicit FMAs), except the N % 8
// last columns and a transposed B (B given as [N x K]), whose elements are
// dot_fixed's: an order fixed by K alone too.  A row's result therefore
// depends on that row alone, not on M, on the rows beside it or on the tiling
// -- XLA's own dot changes its blocking with M, so a token's logits change
// with the batch around it.  Work items are (row block, column panel), each
// computed by one thread.

constexpr int64_t kMmRows = 144, kMmCols = 64;

// Runs item(i) for i < n on the calling thread and up to threads - 1 of XLA's
// pool threads; returns once every item is done.
void run_items(ffi::ThreadPool& pool, int64_t n, int64_t threads,
               std::function<void(int64_t)> item) {
  struct Queue {
    std::function<void(int64_t)> item;
    int64_t n;
    std::atomic<int64_t> next{0}, active{0};
    void drain() {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) item(i);
    }
  };
  auto q = std::make_shared<Queue>();
  q->item = std::move(item);
  q->n = n;
  for (int64_t t = 1; t < std::min(threads, n); ++t) {
    pool.Schedule([q]() {
      q->active.fetch_add(1);
      q->drain();
      q->active.fetch_sub(1);
    });
  }
  q->drain();
  while (q->active.load() != 0) std::this_thread::yield();  // as in PagedAttentionImpl
}

// The threads a call runs on: XLA's intra-op pool, at most the host's cores and max_threads (> 0).
int64_t call_threads(ffi::ThreadPool& pool, int64_t max_threads) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  threads = std::min<int64_t>(threads, std::max<int64_t>(1, std::thread::hardware_concurrency()));
  return max_threads > 0 ? std::min(threads, max_threads) : threads;
}

inline vf vfma(vf a, vf b, vf c) {  // a * b + c, rounded once
#if defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vf r;
  for (int i = 0; i < kLanes; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// C rows crow[i] (i < rows <= 6), NV * 8 columns, of A rows arow[i] . B[K x NV*8]
// (row stride ldb).  Always 6 rows (missing ones repeat a real one, unstored)
// and explicit FMAs, so a row's arithmetic never depends on its tile.
template <int NV>
void mm_tile(const float* const* arow, const float* b, int64_t ldb, float* const* crow, int rows,
             int64_t K) {
  constexpr int MR = 6;
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = vbcast(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = vload(b + k * ldb + j * kLanes);
    for (int i = 0; i < MR; ++i) {
      const vf ai = vbcast(arow[i][k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(ai, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < NV; ++j) vstore(crow[i] + j * kLanes, acc[i][j]);
}

// x . y over n in an order fixed by n alone: one 8-lane FMA chain over k < n / 8 * 8
// (lane l takes k = l mod 8), summed across lanes (hsum), then the tail chained on.
// dot_tile computes the same for 4 x 3 pairs at once (12 independent chains).
inline float dot_fixed(const float* x, const float* y, int64_t n) {
  vf acc = vbcast(0.0f);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) acc = vfma(vload(x + k), vload(y + k), acc);
  float sum = hsum(acc);
  for (; k < n; ++k) sum = std::fma(x[k], y[k], sum);
  return sum;
}

// c[i][j] = dot_fixed(x[i], y[j], n) for i < rows <= 4, j < cols <= 3 (missing
// rows / columns repeat a real one and are not stored); c[i][j] at out[i * ldo + j].
void dot_tile(const float* const* x, const float* const* y, int64_t n, float* out, int64_t ldo,
              int rows, int cols) {
  vf acc[4][3];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = vbcast(0.0f);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    vf yv[3];
    for (int j = 0; j < 3; ++j) yv[j] = vload(y[j] + k);
    for (int i = 0; i < 4; ++i) {
      const vf xv = vload(x[i] + k);
      for (int j = 0; j < 3; ++j) acc[i][j] = vfma(xv, yv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t t = k; t < n; ++t) sum = std::fma(x[i][t], y[j][t], sum);
      out[i * ldo + j] = sum;
    }
  }
}

// Rows [0, rows) and columns [col0, col0 + cols) of C = A . B^T, B [N x K] (a tied
// LM head as stored): each element a dot_fixed of two contiguous rows.
void matmul_block_bt(const float* a, const float* b, float* c, int64_t K, int64_t N, int64_t rows,
                     int64_t col0, int64_t cols) {
  for (int64_t j0 = col0; j0 < col0 + cols; j0 += 3) {
    const int nc = static_cast<int>(std::min<int64_t>(3, col0 + cols - j0));
    const float* y[3];
    for (int j = 0; j < 3; ++j) y[j] = b + (j0 + std::min(j, nc - 1)) * K;
    for (int64_t i0 = 0; i0 < rows; i0 += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, rows - i0));
      const float* x[4];
      for (int i = 0; i < 4; ++i) x[i] = a + (i0 + std::min(i, nr - 1)) * K;
      dot_tile(x, y, K, c + i0 * N + j0, N, nr, nc);
    }
  }
}

// Rows [0, rows) and columns [col0, col0 + cols) of C = A . B (A: rows x K, B: K x N).
void matmul_block(const float* a, const float* b, float* c, int64_t K, int64_t N, int64_t rows,
                  int64_t col0, int64_t cols) {
  const int64_t vec_cols = cols / kLanes * kLanes, vec_end = col0 + vec_cols;
  // The panel's columns, packed [K x vec_cols]: B's rows are N floats apart, and
  // with a wide B (the LM head) every k would touch another page.
  thread_local std::vector<float> packed;
  packed.resize(K * vec_cols);
  for (int64_t k = 0; k < K; ++k)
    std::memcpy(packed.data() + k * vec_cols, b + k * N + col0, vec_cols * sizeof(float));
  for (int64_t j = col0; j < vec_end; j += 2 * kLanes) {
    for (int64_t i0 = 0; i0 < rows; i0 += 6) {
      const int n = static_cast<int>(std::min<int64_t>(6, rows - i0));
      const float* arow[6];
      float* crow[6];
      for (int i = 0; i < 6; ++i) {
        arow[i] = a + (i0 + std::min(i, n - 1)) * K;
        crow[i] = c + (i0 + i) * N + j;
      }
      const float* panel = packed.data() + (j - col0);
      if (j + 2 * kLanes <= vec_end)
        mm_tile<2>(arow, panel, vec_cols, crow, n, K);
      else
        mm_tile<1>(arow, panel, vec_cols, crow, n, K);
    }
  }
  // Columns past the last multiple of 8 (a row sum against ones among them):
  // the column packed, then a dot product per row (dot_fixed).
  thread_local std::vector<float> column;
  column.resize(K);
  for (int64_t j = vec_end; j < col0 + cols; ++j) {
    for (int64_t k = 0; k < K; ++k) column[k] = b[k * N + j];
    for (int64_t i = 0; i < rows; ++i) c[i * N + j] = dot_fixed(a + i * K, column.data(), K);
  }
}

// Skinny matmul (a decode step's weight matmuls): C[M, N] = A[M, K] . B[K, N] in
// fp32 for a few rows M, reading B once.  XLA:CPU's dot runs a small-M product
// like a large one and costs several passes over the weights (measured on the
// 2-core AVX2 VM, SmolLM2's 30 MLPs: 4 rows 2.5x one row, 8 rows 3x); here B's
// rows stream past contiguously, eight at a time, against accumulators for every
// row of a column panel that stay in L1 (kSkinnyAccFloats), so up to ~16 rows
// cost about one pass over B.  Work items are (column panel, k half): each is
// one thread's; the two halves' sums are added in a fixed order afterwards, so
// the result depends on neither the thread count nor the panel width.

constexpr int64_t kSkinnyAccFloats = 4096;  // a panel's accumulators for every row: 16 KB
constexpr int64_t kSkinnyKChunks = 2;        // k halves (work items; fixed: they set the rounding)

// B rows [k0, k1)'s part of C's columns [col0, col0 + cols) (a multiple of 8,
// M * cols <= kSkinnyAccFloats), every row, into out (row stride N).
void skinny_part(const float* a, const float* b, float* out, int64_t M, int64_t K, int64_t N,
                 int64_t k0, int64_t k1, int64_t col0, int64_t cols) {
  alignas(32) float acc[kSkinnyAccFloats];
  const int64_t nv = cols / kLanes;
  std::fill(acc, acc + M * cols, 0.0f);
  int64_t k = k0;
  // Eight rows of B per pass over the accumulators (one load and store of each per
  // eight FMAs): measured 1.4x the bandwidth of four rows at 4 and 8 rows of A.
  for (; k + 8 <= k1; k += 8) {
    const float* r0 = b + k * N + col0;
    for (int64_t i = 0; i < M; ++i) {
      const float* ai = a + i * K + k;
      vf av[8];
      for (int g = 0; g < 8; ++g) av[g] = vbcast(ai[g]);
      vf* ci = reinterpret_cast<vf*>(acc + i * cols);
      for (int64_t j = 0; j < nv; ++j) {
        vf s = ci[j];
        for (int g = 0; g < 8; ++g) s = vfma(av[g], vload(r0 + g * N + j * kLanes), s);
        ci[j] = s;
      }
    }
  }
  for (; k + 4 <= k1; k += 4) {
    const float* r0 = b + k * N + col0;
    const float* r1 = r0 + N;
    const float* r2 = r1 + N;
    const float* r3 = r2 + N;
    for (int64_t i = 0; i < M; ++i) {
      const float* ai = a + i * K + k;
      const vf a0 = vbcast(ai[0]), a1 = vbcast(ai[1]), a2 = vbcast(ai[2]), a3 = vbcast(ai[3]);
      vf* ci = reinterpret_cast<vf*>(acc + i * cols);
      for (int64_t j = 0; j < nv; ++j) {
        vf s = ci[j];
        s = vfma(a0, vload(r0 + j * kLanes), s);
        s = vfma(a1, vload(r1 + j * kLanes), s);
        s = vfma(a2, vload(r2 + j * kLanes), s);
        s = vfma(a3, vload(r3 + j * kLanes), s);
        ci[j] = s;
      }
    }
  }
  for (; k < k1; ++k) {
    const float* r0 = b + k * N + col0;
    for (int64_t i = 0; i < M; ++i) {
      const vf a0 = vbcast(a[i * K + k]);
      vf* ci = reinterpret_cast<vf*>(acc + i * cols);
      for (int64_t j = 0; j < nv; ++j) ci[j] = vfma(a0, vload(r0 + j * kLanes), ci[j]);
    }
  }
  for (int64_t i = 0; i < M; ++i) std::memcpy(out + i * N + col0, acc + i * cols, cols * sizeof(float));
}

// Rows [r0, r1) of C = A . B (b [K, N]) from the k chunks' partial sums pp
// [kSkinnyKChunks, R, N], added in order; columns past the last multiple of 8 as
// one FMA chain each.
void skinny_finish_rows(const float* a, const float* b, const float* pp, float* c, int64_t R, int64_t K,
                        int64_t N, int64_t r0, int64_t r1) {
  const int64_t vec_n = N / kLanes * kLanes;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < vec_n; ++j) {
      float s = pp[r * N + j];
      for (int64_t kc = 1; kc < kSkinnyKChunks; ++kc) s += pp[(kc * R + r) * N + j];
      c[r * N + j] = s;
    }
    for (int64_t j = vec_n; j < N; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(a[r * K + k], b[k * N + j], s);
      c[r * N + j] = s;
    }
  }
}

// The transposed form, C = A . B^T with B [N, K] (a tied LM head as stored): rows
// of B stream past contiguously, eight at a time, each against every row of A
// (in L1); one 8-lane FMA chain per (row of A, row of B), then the eight chains
// of a row of A are summed across lanes together (sum8_lanes) and the k tail is
// chained on.  The order depends on K alone.

// Lane j of the result: the lanes of v[j] summed ((0+1)+(2+3))+((4+5)+(6+7)).
inline vf sum8_lanes(const vf* v) {
  auto pair = [](vf x, vf y) {
    return __builtin_shuffle(x, y, vi{0, 8, 2, 10, 4, 12, 6, 14}) +
           __builtin_shuffle(x, y, vi{1, 9, 3, 11, 5, 13, 7, 15});
  };
  auto quad = [](vf x, vf y) {
    return __builtin_shuffle(x, y, vi{0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(x, y, vi{2, 3, 10, 11, 6, 7, 14, 15});
  };
  const vf lo = quad(pair(v[0], v[1]), pair(v[2], v[3]));
  const vf hi = quad(pair(v[4], v[5]), pair(v[6], v[7]));
  return __builtin_shuffle(lo, hi, vi{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(lo, hi, vi{4, 5, 6, 7, 12, 13, 14, 15});
}

// C's columns [n0, n1) (n1 - n0 a multiple of 8), every row.
void skinny_nt_part(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
                    int64_t n0, int64_t n1) {
  const int64_t kv = K / kLanes * kLanes;
  for (int64_t n = n0; n < n1; n += kLanes) {
    const float* bn = b + n * K;
    for (int64_t i = 0; i < M; ++i) {
      const float* ai = a + i * K;
      vf acc[kLanes];
      for (int j = 0; j < kLanes; ++j) acc[j] = vbcast(0.0f);
      for (int64_t k = 0; k < kv; k += kLanes) {
        const vf av = vload(ai + k);
        for (int j = 0; j < kLanes; ++j) acc[j] = vfma(av, vload(bn + j * K + k), acc[j]);
      }
      vf sum = sum8_lanes(acc);
      for (int64_t k = kv; k < K; ++k)
        for (int j = 0; j < kLanes; ++j) sum[j] = std::fma(ai[k], bn[j * K + k], sum[j]);
      std::memcpy(c + i * N + n, &sum, sizeof(sum));
    }
  }
}

constexpr int64_t kSkinnyNtRows = 256;  // rows of B per work item

void skinny_matmul_nt(ffi::ThreadPool& pool, const float* a, const float* b, float* c, int64_t M, int64_t K,
                      int64_t N, int64_t threads) {
  const int64_t vec_n = N / kLanes * kLanes;
  const int64_t items = (vec_n + kSkinnyNtRows - 1) / kSkinnyNtRows;
  if (items > 0)
    run_items(pool, items, threads, [=](int64_t item) {
      skinny_nt_part(a, b, c, M, K, N, item * kSkinnyNtRows, std::min(vec_n, (item + 1) * kSkinnyNtRows));
    });
  for (int64_t i = 0; i < M; ++i)  // rows of B past the last multiple of 8
    for (int64_t n = vec_n; n < N; ++n) c[i * N + n] = dot_fixed(a + i * K, b + n * K, K);
}

// ---------------------------------------------------------------------------
// GGUF block weights (jpaged.loading.gguf_blocks): a quantised GGUF's matrices in
// their own blocks of 32 -- 4-bit codes with a scale and an offset each (Q4_0,
// Q4_1) or 8-bit codes with a scale (Q8_0) -- registered under the address of
// the float32 weight the engine dequantised from them.  A skinny matmul whose
// weight buffer is registered reads the blocks instead (~5 or ~8.5 bits a weight,
// not 32): a decode step is bound by reading its weights.  Each weight is
// dequantised exactly as gguf.quants does (d * q + m: the product is exact, so one
// rounding, as in the FMA), and the products are summed in the transposed form's
// order (skinny_nt_part): the result is bit-identical to skinny_matmul_cpu of the
// dequantised weight, transposed.  The registry holds no memory: the caller keeps
// the blocks alive until it unregisters them (which waits for calls in flight).

struct BlockWeights {
  int32_t kind;          // kBlocksQ4 or kBlocksQ8
  int64_t n, k;          // the weight is [n, k] in GGUF's layout (rows of k, blocks of 32)
  bool transposed;       // the float32 buffer it stands for is [n, k] (read transposed), not [k, n]
  const uint8_t* codes;  // Q4: [n, k / 2], byte t of a block = elements t (low nibble), t + 16 (high);
                         // Q8: [n, k] int8
  const float* scales;   // [n, k / 32]
  const float* offsets;  // Q4: [n, k / 32]; Q8: unused
};
constexpr int32_t kBlocksQ4 = 0, kBlocksQ8 = 1;
constexpr int64_t kBlockSize = 32;
constexpr int64_t kBlockRowsPerItem = 64;  // rows of the weight per work item

std::shared_mutex blocks_mutex;
std::unordered_map<const void*, BlockWeights> blocks_registry;
std::atomic<int64_t> block_matmul_calls{0};

// The 32 weights of one block as four 8-lane vectors, in k order.
inline void dequant_block(const BlockWeights& w, int64_t row, int64_t blk, vf out[4]) {
  const float d = w.scales[row * (w.k / kBlockSize) + blk];
  if (w.kind == kBlocksQ8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.codes) + row * w.k + blk * kBlockSize;
#if defined(__AVX2__)
    for (int t = 0; t < 4; ++t)
      out[t] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * t)))) *
               vbcast(d);
#else
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < kLanes; ++l) out[t][l] = static_cast<float>(q[8 * t + l]) * d;
#endif
    return;
  }
  const float m = w.offsets[row * (w.k / kBlockSize) + blk];
  const uint8_t* q = w.codes + row * (w.k / 2) + blk * (kBlockSize / 2);
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, nib), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int t = 0; t < 4; ++t)
    out[t] = vfma((vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[t])), vbcast(d), vbcast(m));
#else
  for (int l = 0; l < 16; ++l) {
    out[l / 8][l % 8] = std::fma(static_cast<float>(q[l] & 15), d, m);
    out[2 + l / 8][l % 8] = std::fma(static_cast<float>(q[l] >> 4), d, m);
  }
#endif
}

// c[i, n0 .. n0 + 8) for MB rows of a (row stride K): each weight row's blocks
// dequantised once for all MB rows; per (row of a, row of w) one 8-lane FMA chain
// over k, then sum8_lanes across the eight weight rows, as skinny_nt_part does.
template <int MB>
void block_rows8(const BlockWeights& w, const float* a, float* c, int64_t K, int64_t N, int64_t n0) {
  vf chains[MB][kLanes];
  const int64_t blocks = K / kBlockSize;
  for (int j = 0; j < kLanes; ++j) {
    vf acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = vbcast(0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      vf wv[4];
      dequant_block(w, n0 + j, b, wv);
      for (int i = 0; i < MB; ++i) {
        const float* ai = a + i * K + b * kBlockSize;
        for (int t = 0; t < 4; ++t) acc[i] = vfma(vload(ai + t * kLanes), wv[t], acc[i]);
      }
    }
    for (int i = 0; i < MB; ++i) chains[i][j] = acc[i];
  }
  for (int i = 0; i < MB; ++i) {
    const vf sum = sum8_lanes(chains[i]);
    std::memcpy(c + i * N + n0, &sum, sizeof(sum));
  }
}

// Rows of A in groups of up to eight (their chains stay in registers), for the
// weight's rows [r0, r1) (multiples of 8).
void block_part(const BlockWeights& w, const float* a, float* c, int64_t M, int64_t K, int64_t N, int64_t r0,
                int64_t r1) {
  for (int64_t n = r0; n < r1; n += kLanes)
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const float* am = a + m0 * K;
      float* cm = c + m0 * N;
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: block_rows8<1>(w, am, cm, K, N, n); break;
        case 2: block_rows8<2>(w, am, cm, K, N, n); break;
        case 3: block_rows8<3>(w, am, cm, K, N, n); break;
        case 4: block_rows8<4>(w, am, cm, K, N, n); break;
        case 5: block_rows8<5>(w, am, cm, K, N, n); break;
        case 6: block_rows8<6>(w, am, cm, K, N, n); break;
        case 7: block_rows8<7>(w, am, cm, K, N, n); break;
        default: block_rows8<8>(w, am, cm, K, N, n); break;
      }
    }
}

// C = A . W^T from the blocks; rows of W past the last multiple of 8 dequantised
// whole and taken by dot_fixed (as skinny_matmul_nt's tail rows).
void block_matmul(ffi::ThreadPool& pool, const BlockWeights& w, const float* a, float* c, int64_t M,
                  int64_t threads) {
  const int64_t K = w.k, N = w.n, vec_n = N / kLanes * kLanes;
  const int64_t items = (vec_n + kBlockRowsPerItem - 1) / kBlockRowsPerItem;
  if (items > 0)
    run_items(pool, items, threads, [&w, a, c, M, K, N, vec_n](int64_t item) {
      block_part(w, a, c, M, K, N, item * kBlockRowsPerItem, std::min(vec_n, (item + 1) * kBlockRowsPerItem));
    });
  if (vec_n == N) return;
  std::vector<float> row(K);  // a tail row, dequantised
  for (int64_t n = vec_n; n < N; ++n) {
    for (int64_t b = 0; b < K / kBlockSize; ++b) {
      vf wv[4];
      dequant_block(w, n, b, wv);
      std::memcpy(row.data() + b * kBlockSize, wv, sizeof(wv));
    }
    for (int64_t i = 0; i < M; ++i) c[i * N + n] = dot_fixed(a + i * K, row.data(), K);
  }
}

// Runs C = A . W^T from the blocks registered for `weight` when there are blocks
// of W's shape [N, K], registered for the layout the call reads the buffer in (a
// square weight's shape alone cannot tell); false (nothing done) otherwise.
bool run_registered_blocks(ffi::ThreadPool& pool, const void* weight, const float* a, float* c, int64_t M,
                           int64_t K, int64_t N, bool transpose_b, int64_t threads) {
  std::shared_lock<std::shared_mutex> lock(blocks_mutex);
  auto it = blocks_registry.find(weight);
  if (it == blocks_registry.end() || it->second.n != N || it->second.k != K ||
      it->second.transposed != transpose_b)
    return false;
  block_matmul(pool, it->second, a, c, M, threads);
  block_matmul_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> a,
                            ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c, int64_t max_threads,
                            bool transpose_b) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[transpose_b ? 1 : 0])
    return ffi::Error::InvalidArgument("skinny_matmul_cpu: need a [M, K] and b [K, N] ([N, K] transposed)");
  const int64_t M = ad[0], K = ad[1], N = bd[transpose_b ? 0 : 1];
  auto cd = c->dimensions();
  if (cd.size() != 2 || cd[0] != M || cd[1] != N)
    return ffi::Error::InvalidArgument("skinny_matmul_cpu: the result must be [M, N]");
  if (M * kLanes > kSkinnyAccFloats)
    return ffi::Error::InvalidArgument("skinny_matmul_cpu: more rows than a panel's accumulators hold");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* ap = a.typed_data();
  const float* bp = b.typed_data();
  float* cp = c->typed_data();
  const int64_t threads = call_threads(pool_threads, max_threads);
  if (run_registered_blocks(pool_threads, bp, ap, cp, M, K, N, transpose_b, threads)) return ffi::Error::Success();
  if (transpose_b) {
    skinny_matmul_nt(pool_threads, ap, bp, cp, M, K, N, threads);
    return ffi::Error::Success();
  }
  // Panels: as wide as the accumulators allow, and narrower where that leaves a
  // thread without two items.
  const int64_t vec_n = N / kLanes * kLanes;
  const int64_t widest = kSkinnyAccFloats / M / kLanes * kLanes;
  const int64_t wanted = std::max<int64_t>(1, 2 * threads / kSkinnyKChunks);
  const int64_t even = (vec_n + wanted - 1) / wanted;
  const int64_t width = std::min(widest, std::max<int64_t>(8 * kLanes, (even + kLanes - 1) / kLanes * kLanes));
  const int64_t panels = (vec_n + width - 1) / width;
  const int64_t kstep = (K + kSkinnyKChunks - 1) / kSkinnyKChunks;
  thread_local std::vector<float> partial;  // [kSkinnyKChunks, M, N]
  partial.resize(kSkinnyKChunks * M * N);
  float* pp = partial.data();
  if (panels > 0)
    run_items(pool_threads, panels * kSkinnyKChunks, threads, [=](int64_t item) {
      const int64_t kc = item % kSkinnyKChunks, j0 = item / kSkinnyKChunks * width;
      skinny_part(ap, bp, pp + kc * M * N, M, K, N, std::min(K, kc * kstep), std::min(K, (kc + 1) * kstep),
                  j0, std::min(width, vec_n - j0));
    });
  skinny_finish_rows(ap, bp, pp, cp, M, K, N, 0, M);
  return ffi::Error::Success();
}

// Grouped skinny matmul (a MoE layer's experts in a decode step): rows a [R, K]
// sorted by expert, group_sizes [E] rows each, c[r] = a[r] . b[e(r)] with
// b [E, K, N].  Each expert with rows reads its weights once, as the skinny
// matmul does (chunks of kSkinnyGroupRows rows, panels x k halves, the halves
// added in a fixed order), so a row's result depends on neither the thread count
// nor the other rows.  Rows past the groups' total are zero.
constexpr int64_t kSkinnyGroupRows = 32;

ffi::Error GroupedSkinnyMatmulImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> a,
                                   ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::F32> b,
                                   ffi::ResultBuffer<ffi::F32> c, int64_t max_threads) {
  auto ad = a.dimensions();
  auto gd = group_sizes.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 3 || gd.size() != 1 || ad[1] != bd[1] || gd[0] != bd[0])
    return ffi::Error::InvalidArgument(
        "grouped_skinny_matmul_cpu: need a [R, K], group_sizes [E] and b [E, K, N]");
  const int64_t R = ad[0], K = ad[1], E = bd[0], N = bd[2];
  auto cd = c->dimensions();
  if (cd.size() != 2 || cd[0] != R || cd[1] != N)
    return ffi::Error::InvalidArgument("grouped_skinny_matmul_cpu: the result must be [R, N]");
  if (R == 0 || N == 0) return ffi::Error::Success();
  const float* ap = a.typed_data();
  const float* bp = b.typed_data();
  const int32_t* gs = group_sizes.typed_data();
  float* cp = c->typed_data();
  const int64_t threads = call_threads(pool_threads, max_threads);
  // (expert, first row, rows) of each chunk of a group; rows past R are dropped.
  struct Chunk { int64_t expert, row0, rows, width, panels; };
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_item;
  const int64_t vec_n = N / kLanes * kLanes;
  int64_t row = 0, items = 0;
  for (int64_t e = 0; e < E && row < R; ++e) {
    const int64_t end = std::min(R, row + std::max<int64_t>(0, gs[e]));
    for (int64_t r0 = row; r0 < end; r0 += kSkinnyGroupRows) {
      const int64_t rows = std::min(kSkinnyGroupRows, end - r0);
      const int64_t width = std::min(std::max<int64_t>(kLanes, kSkinnyAccFloats / rows / kLanes * kLanes),
                                     std::max<int64_t>(kLanes, vec_n));
      const int64_t panels = vec_n > 0 ? (vec_n + width - 1) / width : 0;
      chunks.push_back({e, r0, rows, width, panels});
      first_item.push_back(items);
      items += panels * kSkinnyKChunks;
    }
    row = end;
  }
  const int64_t total = row;
  const int64_t kstep = (K + kSkinnyKChunks - 1) / kSkinnyKChunks;
  thread_local std::vector<float> partial;  // [kSkinnyKChunks, R, N]
  partial.resize(kSkinnyKChunks * R * N);
  float* pp = partial.data();
  const Chunk* ch = chunks.data();
  const int64_t* fi = first_item.data();
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  if (items > 0)
    run_items(pool_threads, items, threads, [=](int64_t item) {
      const int64_t ci = std::upper_bound(fi, fi + nchunks, item) - fi - 1;
      const Chunk& ck = ch[ci];
      const int64_t local = item - fi[ci], kc = local % kSkinnyKChunks, j0 = local / kSkinnyKChunks * ck.width;
      skinny_part(ap + ck.row0 * K, bp + ck.expert * K * N, pp + (kc * R + ck.row0) * N, ck.rows, K, N,
                  std::min(K, kc * kstep), std::min(K, (kc + 1) * kstep), j0, std::min(ck.width, vec_n - j0));
    });
  for (const Chunk& ck : chunks)
    skinny_finish_rows(ap, bp + ck.expert * K * N, pp, cp, R, K, N, ck.row0, ck.row0 + ck.rows);
  std::fill(cp + total * N, cp + R * N, 0.0f);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> a,
                      ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> c,
                      int64_t max_threads, bool transpose_b, float soft_cap) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[transpose_b ? 1 : 0])
    return ffi::Error::InvalidArgument("matmul_cpu: need a [M, K] and b [K, N] ([N, K] transposed)");
  const int64_t M = ad[0], K = ad[1], N = bd[transpose_b ? 0 : 1];
  auto cd = c->dimensions();
  if (cd.size() != 2 || cd[0] != M || cd[1] != N)
    return ffi::Error::InvalidArgument("matmul_cpu: the result must be [M, N]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* ap = a.typed_data();
  const float* bp = b.typed_data();
  float* cp = c->typed_data();
  if (K == 0) {
    std::fill(cp, cp + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t row_blocks = (M + kMmRows - 1) / kMmRows, panels = (N + kMmCols - 1) / kMmCols;
  const int64_t threads = call_threads(pool_threads, max_threads);
  // Row-block-major: consecutive items share their block of A.
  run_items(pool_threads, row_blocks * panels, threads, [=](int64_t item) {
    const int64_t i0 = item / panels * kMmRows, j0 = item % panels * kMmCols;
    const int64_t rows = std::min(kMmRows, M - i0), cols = std::min(kMmCols, N - j0);
    if (transpose_b)
      matmul_block_bt(ap + i0 * K, bp, cp + i0 * N, K, N, rows, j0, cols);
    else
      matmul_block(ap + i0 * K, bp, cp + i0 * N, K, N, rows, j0, cols);
    if (soft_cap > 0.0f) {  // Gemma's final logit cap, here so that no later op fuses into it
      const float inv = 1.0f / soft_cap;
      for (int64_t i = i0; i < i0 + rows; ++i)
        for (int64_t j = j0; j < j0 + cols; ++j) cp[i * N + j] = soft_cap * std::tanh(cp[i * N + j] * inv);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// K/V write, in place.  XLA:CPU lowers a scatter into a bf16 (or fp8) buffer
// by converting the whole buffer to f32 and back; this touches only the rows
// written.  Rows of a quantized pool arrive quantized (D values, then the
// code: D + 1 bytes): the values go to the token's row of its page, the code
// to element `off` of the page's code row (row BS).

template <typename PT, typename KT>
void write_rows(void* pool, const void* k, const void* v, const int32_t* blocks,
                const int32_t* offsets, int64_t T, int64_t NB, int64_t L, int64_t KVH, int64_t BS,
                int64_t D, int64_t layer, bool quant) {
  PT* dst_pool = static_cast<PT*>(pool);
  const KT* src[2] = {static_cast<const KT*>(k), static_cast<const KT*>(v)};
  const int64_t Pr = BS + (quant ? 1 : 0), Dk = D + (quant ? 1 : 0);  // page rows, k/v row length
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = blocks[t], off = offsets[t];
    if (blk < 0 || blk >= NB || off < 0 || off >= BS) continue;
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t h = 0; h < KVH; ++h) {
        PT* page = dst_pool + (((blk * L + layer) * 2 + kv) * KVH + h) * Pr * D;
        PT* dst = page + off * D;
        const KT* row = src[kv] + (t * KVH + h) * Dk;
        if constexpr (sizeof(PT) == sizeof(KT)) {
          std::memcpy(dst, row, D * sizeof(PT));
          if (quant) std::memcpy(page + BS * D + off, row + D, sizeof(PT));
        } else {
          for (int64_t i = 0; i < D; ++i) store_f(dst + i, load_f(row[i]));
        }
      }
    }
  }
}

ffi::Error WriteKvImpl(ffi::AnyBuffer pool, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> blocks,
                       ffi::Buffer<ffi::S32> offsets, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (pd.size() != 6 || pd[2] != 2)
    return ffi::Error::InvalidArgument("write_kv_cpu: kv_pool must be [NB, L, 2, KVH, BS, D]");
  const bool quant = pool.element_type() == ffi::DataType::S8 ||
                     pool.element_type() == ffi::DataType::F8E4M3FN;
  if (kd.size() != 3 || kd[1] != pd[3] || kd[2] != pd[5] + (quant ? 1 : 0) || vd.size() != 3 ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return ffi::Error::InvalidArgument(
        "write_kv_cpu: k and v must be [T, KVH, D] matching the pool ([T, KVH, D + 1] quantized "
        "rows, the code last, for an int8 / float8_e4m3fn pool)");
  if (quant && (pd[4] < 2 || pd[4] - 1 > pd[5]))
    return ffi::Error::InvalidArgument(
        "write_kv_cpu: a quantized pool's pages are [block_size + 1, head_dim] with "
        "1 <= block_size <= head_dim");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("write_kv_cpu: k and v dtypes differ");
  if (blocks.element_count() != static_cast<size_t>(kd[0]) ||
      offsets.element_count() != static_cast<size_t>(kd[0]))
    return ffi::Error::InvalidArgument("write_kv_cpu: blocks and offsets must be [T]");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("write_kv_cpu: layer must be a scalar");
  if (out->element_type() != pool.element_type() || out->size_bytes() != pool.size_bytes())
    return ffi::Error::InvalidArgument("write_kv_cpu: output must match the pool");
  const auto pt = pool.element_type(), kt = k.element_type();
  const bool p32 = pt == ffi::DataType::F32, k32 = kt == ffi::DataType::F32;
  // A quantized pool takes rows quantized already (by quantize_rows, the one
  // quantizer), of its own dtype, the code last: they are copied as bytes.
  if (quant ? kt != pt
            : (!p32 && pt != ffi::DataType::BF16) || (!k32 && kt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(
        "write_kv_cpu: pool and k/v must be f32 or bf16, or k/v quantized rows of the pool's "
        "dtype (int8, float8_e4m3fn)");
  if (out->untyped_data() != pool.untyped_data())  // XLA did not alias: copy, then write
    std::memcpy(out->untyped_data(), pool.untyped_data(), pool.size_bytes());
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= pd[1]) return ffi::Error::Success();  // dropped, like the scatter
  auto fn = quant ? write_rows<uint8_t, uint8_t>
           : p32  ? (k32 ? write_rows<float, float> : write_rows<float, uint16_t>)
                  : (k32 ? write_rows<uint16_t, float> : write_rows<uint16_t, uint16_t>);
  fn(out->untyped_data(), k.untyped_data(), v.untyped_data(), blocks.typed_data(),
     offsets.typed_data(), kd[0], pd[0], pd[1], pd[3], pd[4] - (quant ? 1 : 0), pd[5], lay, quant);
  return ffi::Error::Success();
}

}  // namespace

// The registry of GGUF block weights (ctypes, from pallas_kernels.cpu): 0 on
// success, -1 for a shape the blocks cannot have.
extern "C" int jpaged_register_block_weights(const void* weight, int32_t kind, int64_t n, int64_t k,
                                             int32_t transposed, const void* codes, const float* scales,
                                             const float* offsets) {
  if ((kind != kBlocksQ4 && kind != kBlocksQ8) || n <= 0 || k <= 0 || k % kBlockSize != 0 || !codes ||
      !scales || (kind == kBlocksQ4 && !offsets))
    return -1;
  std::unique_lock<std::shared_mutex> lock(blocks_mutex);
  blocks_registry[weight] =
      BlockWeights{kind, n, k, transposed != 0, static_cast<const uint8_t*>(codes), scales, offsets};
  return 0;
}

// Forgets `weight`'s blocks once no call is reading them; 1 if it had any.
extern "C" int jpaged_unregister_block_weights(const void* weight) {
  std::unique_lock<std::shared_mutex> lock(blocks_mutex);
  return static_cast<int>(blocks_registry.erase(weight));
}

// Skinny matmuls served from registered blocks since the library was loaded.
extern "C" int64_t jpaged_block_matmul_calls() { return block_matmul_calls.load(); }


XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()         // kv_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Ret<ffi::AnyBuffer>()         // out [T, H, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("window")       // 0: no sliding window
                                  .Attr<float>("soft_cap")       // 0: no soft cap
                                  .Attr<int64_t>("token_tile")); // tokens per item; 0: 48 / G

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedWriteKvCpu, WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // kv_pool (aliased to the result)
                                  .Arg<ffi::AnyBuffer>()         // k [T, KVH, D (+ 1: the code, quantized)]
                                  .Arg<ffi::AnyBuffer>()         // v [T, KVH, D (+ 1: the code, quantized)]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // blocks [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offsets [T]
                                  .Ret<ffi::AnyBuffer>());       // kv_pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // c [M, N]
                                  .Attr<int64_t>("max_threads")
                                  .Attr<bool>("transpose_b")     // b is [N, K]
                                  .Attr<float>("soft_cap"));     // c = cap * tanh(c / cap); 0: none

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedGroupedSkinnyMatmulCpu, GroupedSkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [R, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b [E, K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // c [R, N]
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedSkinnyMatmulCpu, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b [K, N], or [N, K] transposed
                                  .Ret<ffi::Buffer<ffi::F32>>()  // c [M, N]
                                  .Attr<int64_t>("max_threads")
                                  .Attr<bool>("transpose_b"));
