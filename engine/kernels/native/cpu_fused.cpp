// The Llama decoder's small per-layer ops, fused, for x86-64 CPUs with AVX-512: each is
// one pass over its rows instead of the 3-9 torch ops (and their temporaries) eager
// mode runs. Built and loaded by engine/kernels/native_build.py with -ffp-contract=off,
// called through ctypes from engine/kernels/cpu_fused.py. Each call splits its rows into
// as many equal runs as it is given threads (the caller gives one for few rows), on the
// OpenMP threads torch's ops already run on (-fopenmp: the library's libgomp.so.1
// resolves to torch's copy, as cpu_attention.cpp's does). Every kernel rounds where
// eager torch (and Hugging Face transformers) round, so a bfloat16 model computes the
// same values:
//
//   add_rmsnorm   res = bf(res + x);  out = bf(w * bf(res * 1/sqrt(sum(res^2)/N + eps)))
//   rope_kv       q, k = bf(bf(q * cos) + bf(rotate_half(q) * sin)); k, v -> cache slots
//   silu_mul      out = bf(bf(g / (1 + exp(-g))) * u)
//   argmax_rows   each float32 row's index of its largest value (greedy sampling)
//
// where bf() is the round to nearest even of c10::BFloat16 (identity for float32), and
// each product or sum is one float32 operation (no FMA contraction). The two places
// where the order or the algorithm is torch's own are copied from it: RMSNorm's sum of
// squares follows the order of torch's float sum (sum_squares) and exp() is
// SLEEF's expf_u10, torch's Vectorized<float>::exp (exp16). So on a CPU where torch
// runs its AVX-512 kernels (the CPUs these kernels build for) the results are those of
// the eager ops bit for bit, in float32 and bfloat16 (tests/engine/kernels/
// test_cpu_fused.py); SiLU is, where the eager op would split a row between threads
// only at multiples of 64 elements (SmolLM2's 1,536 and the tiny model's 128 are).
//
// Layout: rows of `width` elements with a row stride in elements; bfloat16 as uint16 bits.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

namespace {

using kvt_simd::exp16;
using kvt_simd::round_bf16;

// ---- bfloat16 <-> float32, 16 lanes (c10::BFloat16's round to nearest even) ----
inline __m512 widen(const uint16_t* p, __mmask16 m) {
    __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 widen(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 round_to(const uint16_t*, __m512 x) { return round_bf16(x); }
inline __m512 round_to(const float*, __m512 x) { return x; }

inline void store(uint16_t* p, __m512 x, __mmask16 m) {  // x already rounded
    __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
    _mm256_mask_storeu_epi16(p, m, bits);
}
inline void store(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }

inline __mmask16 lanes(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// ``run(first, count)`` over rows [0, rows): one run each for up to ``threads`` OpenMP
// threads (rows are independent, so any split gives the same values).
template <typename Run>
inline void over_rows(int rows, int threads, Run run) {
    if (threads <= 1 || rows < 2) {
        run(0, rows);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int n = omp_get_num_threads(), t = omp_get_thread_num();
        const int a = int(int64_t(rows) * t / n), b = int(int64_t(rows) * (t + 1) / n);
        if (b > a) run(a, b - a);
    }
}

// The float32 sum of squares of a row of n (>= 8) elements in the order of torch's float
// sum over a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum
// -> row_sum -> multi_row_sum), whose sum runs its AVX2 code on AVX-512 CPUs too:
// vectors of 8 in 4 interleaved accumulators with cascade levels, those 4 added, then
// the scalar tail, then the 8 lanes one by one.
inline __m256 squares8(const float* p) { __m256 v = _mm256_loadu_ps(p); return _mm256_mul_ps(v, v); }
inline __m256 squares8(const uint16_t* p) {
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    return _mm256_mul_ps(v, v);
}
inline float widen1(const float* p) { return *p; }
inline float widen1(const uint16_t* p) {
    uint32_t bits = uint32_t(*p) << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

template <typename T>
inline float sum_squares(const T* h, int n) {
    constexpr int L = 8, levels = 4;
    auto vec = [h](int64_t i) { return squares8(h + L * i); };
    const int64_t vec_size = n / L, size = vec_size / 4;
    int64_t ceil_log2 = 0;
    while ((int64_t(1) << ceil_log2) < size) ceil_log2++;
    const int64_t power = ceil_log2 / levels > 4 ? ceil_log2 / levels : 4;
    const int64_t step = int64_t(1) << power, mask = step - 1;
    __m256 acc[levels][4];
    for (int j = 0; j < levels; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], vec(4 * i + k));
        for (int j = 1; j < levels; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], vec(4 * i + k));
    for (int j = 1; j < levels; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    __m256 partial = acc[0][0];
    for (int64_t v = size * 4; v < vec_size; v++) partial = _mm256_add_ps(partial, vec(v));
    for (int k = 1; k < 4; k++) partial = _mm256_add_ps(partial, acc[0][k]);
    float total = 0.0f;
    for (int64_t k = vec_size * L; k < n; k++) {
        const float x = widen1(h + k);
        total += x * x;
    }
    alignas(32) float lane[L];
    _mm256_store_ps(lane, partial);
    for (int k = 0; k < L; k++) total += lane[k];
    return total;
}

template <typename T>
void add_rmsnorm(const T* x, int64_t x_stride, T* res, int64_t res_stride, const T* weight,
                 T* out, int64_t out_stride, int rows, int width, float eps) {
    for (int r = 0; r < rows; r++) {
        T* h = res + r * res_stride;
        if (x != nullptr) {
            for (int i = 0; i < width; i += 16) {
                const __mmask16 m = lanes(width - i);
                store(h + i, round_to(h, _mm512_add_ps(widen(h + i, m), widen(x + r * x_stride + i, m))), m);
            }
        }
        const float var = sum_squares(h, width) / float(width);
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(var + eps));
        T* o = out + r * out_stride;
        for (int i = 0; i < width; i += 16) {
            const __mmask16 m = lanes(width - i);
            __m512 normed = round_to(h, _mm512_mul_ps(widen(h + i, m), inv));
            store(o + i, round_to(h, _mm512_mul_ps(widen(weight + i, m), normed)), m);
        }
    }
}

// One head of d elements (d even) rotated by a position's cos/sin rows.
template <typename T>
inline void rotate_head(const T* src, const T* cos, const T* sin, int d, T* dst) {
    const int half = d / 2;
    for (int i = 0; i < half; i += 16) {
        const __mmask16 m = lanes(half - i);
        __m512 lo = widen(src + i, m), hi = widen(src + half + i, m);
        __m512 c_lo = widen(cos + i, m), c_hi = widen(cos + half + i, m);
        __m512 s_lo = widen(sin + i, m), s_hi = widen(sin + half + i, m);
        // out[i] = q[i] cos[i] - q[i+half] sin[i];  out[i+half] = q[i+half] cos + q[i] sin
        __m512 a = round_to(src, _mm512_mul_ps(lo, c_lo));
        __m512 b = round_to(src, _mm512_mul_ps(hi, s_lo));
        __m512 c = round_to(src, _mm512_mul_ps(hi, c_hi));
        __m512 e = round_to(src, _mm512_mul_ps(lo, s_hi));
        store(dst + i, round_to(src, _mm512_sub_ps(a, b)), m);
        store(dst + half + i, round_to(src, _mm512_add_ps(c, e)), m);
    }
}

template <typename T>
inline void copy_head(const T* src, int d, T* dst) {
    for (int i = 0; i < d; i += 16) {
        const __mmask16 m = lanes(d - i);
        store(dst + i, widen(src + i, m), m);
    }
}

// Rows of qkv ([q heads | k heads | v heads] of head_dim each): each row's q heads
// rotated in place, then write_kv(its k heads (its v heads follow), cos, sin, slot)
// puts its K and V into the caches (rope_kv, rope_kv_int8).
template <typename T, typename WriteKV>
void rope_rows(T* qkv, int64_t row_stride, int rows, int num_heads, int head_dim,
               const int64_t* positions, const T* cos_table, const T* sin_table,
               const int64_t* slots, WriteKV write_kv) {
    for (int r = 0; r < rows; r++) {
        T* row = qkv + r * row_stride;
        const T* cos = cos_table + positions[r] * head_dim;
        const T* sin = sin_table + positions[r] * head_dim;
        for (int h = 0; h < num_heads; h++)
            rotate_head(row + h * head_dim, cos, sin, head_dim, row + h * head_dim);
        write_kv(row + int64_t(num_heads) * head_dim, cos, sin, slots[r]);
    }
}

// Float caches: k rotated into k_cache at the row's slot, v copied into v_cache there.
template <typename T>
void rope_kv(T* qkv, int64_t row_stride, int rows, int num_heads, int num_kv_heads,
             int head_dim, const int64_t* positions, const T* cos_table, const T* sin_table,
             const int64_t* slots, T* k_cache, T* v_cache) {
    const int64_t slot_elems = int64_t(num_kv_heads) * head_dim;
    rope_rows(qkv, row_stride, rows, num_heads, head_dim, positions, cos_table, sin_table, slots,
              [&](const T* k_src, const T* cos, const T* sin, int64_t slot) {
                  T* k_dst = k_cache + slot * slot_elems;
                  for (int h = 0; h < num_kv_heads; h++)
                      rotate_head(k_src + h * head_dim, cos, sin, head_dim, k_dst + h * head_dim);
                  copy_head(k_src + slot_elems, int(slot_elems), v_cache + slot * slot_elems);
              });
}

// An int8 KV cache row of one head: d int8 values, then the float32 scale (x = q * scale)
// in the next 4 bytes. Symmetric per (token, head): scale = max|x| / 127 and
// q = round-half-even(x * (127 / max|x|)); the torch reference,
// engine.kernels.kv_int8.quantize_rows, computes the same float32 operations.
constexpr int INT8_SCALE_BYTES = 4;
constexpr int MAX_HEAD_DIM = 256;

inline void quantize_head(const float* x, int d, int8_t* dst) {
    __m512 most = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16)
        most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes(d - i), x + i)));
    const float amax = _mm512_reduce_max_ps(most);
    const float scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = 0; i < d; i += 16) {
        const __mmask16 m = lanes(d - i);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
        _mm_mask_storeu_epi8(dst + i, m, _mm512_cvtsepi32_epi8(q));
    }
    memcpy(dst + d, &scale, sizeof(scale));
}

template <typename T>
inline void widen_head(const T* src, int d, float* dst) {
    for (int i = 0; i < d; i += 16) {
        const __mmask16 m = lanes(d - i);
        _mm512_mask_storeu_ps(dst + i, m, widen(src + i, m));
    }
}

// rope_kv for int8 caches: q rotated in place; k rotated (rounded to T, as the model's
// own K) and v, quantized per head into the caches' rows of head_dim + 4 bytes.
template <typename T>
void rope_kv_int8(T* qkv, int64_t row_stride, int rows, int num_heads, int num_kv_heads,
                  int head_dim, const int64_t* positions, const T* cos_table, const T* sin_table,
                  const int64_t* slots, int8_t* k_cache, int8_t* v_cache) {
    const int64_t head_row = head_dim + INT8_SCALE_BYTES;
    const int64_t slot_bytes = int64_t(num_kv_heads) * head_row;
    alignas(64) T rotated[MAX_HEAD_DIM];
    alignas(64) float wide[MAX_HEAD_DIM];
    rope_rows(qkv, row_stride, rows, num_heads, head_dim, positions, cos_table, sin_table, slots,
              [&](const T* k_src, const T* cos, const T* sin, int64_t slot) {
                  int8_t* k_dst = k_cache + slot * slot_bytes;
                  int8_t* v_dst = v_cache + slot * slot_bytes;
                  const T* v_src = k_src + int64_t(num_kv_heads) * head_dim;
                  for (int h = 0; h < num_kv_heads; h++) {
                      rotate_head(k_src + h * head_dim, cos, sin, head_dim, rotated);
                      widen_head(rotated, head_dim, wide);
                      quantize_head(wide, head_dim, k_dst + h * head_row);
                      widen_head(v_src + h * head_dim, head_dim, wide);
                      quantize_head(wide, head_dim, v_dst + h * head_row);
                  }
              });
}

// torch's SiLU runs its vector code over each contiguous run of elements in steps of two
// vectors (32 float32 or 64 bfloat16 lanes) and its scalar code (std::exp) on the rest.
inline int vector_part(const float*, int n) { return n - n % 32; }
inline int vector_part(const uint16_t*, int n) { return n - n % 64; }

template <typename T>
void silu_mul(const T* gate_up, int64_t in_stride, T* out, int64_t out_stride, int rows,
              int width) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const int vec_end = vector_part(gate_up, width);
    for (int r = 0; r < rows; r++) {
        const T* g = gate_up + r * in_stride;
        const T* u = g + width;
        T* o = out + r * out_stride;
        for (int i = 0; i < width; i += 16) {
            const __mmask16 m = lanes(width - i);
            __m512 gv = widen(g + i, m);
            __m512 e;
            if (i < vec_end) {
                e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            } else {  // the scalar tail: std::exp
                alignas(64) float x[16];
                _mm512_store_ps(x, gv);
                for (int k = 0; k < 16; k++) x[k] = expf(-x[k]);
                e = _mm512_load_ps(x);
            }
            __m512 act = round_to(g, _mm512_div_ps(gv, _mm512_add_ps(one, e)));
            store(o + i, round_to(g, _mm512_mul_ps(act, widen(u + i, m))), m);
        }
    }
}

// The index of each row's largest value: the first of equal ones, and the first NaN where
// a row has one (torch.max(dim=-1)'s and argmax's indices). Lane l keeps the largest value
// of elements l, l + 16, ... and the first index it came from (a later element replaces it
// only when strictly larger); the row's answer is the smallest index among the lanes
// holding the row's maximum. float32 rows (the LM head's logits).
void argmax_rows(const float* x, int64_t stride, int rows, int width, int64_t* out) {
    for (int r = 0; r < rows; r++) {
        const float* row = x + r * stride;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i at = _mm512_set1_epi32(width);  // width: no element yet (an all -inf row)
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (int i = 0; i < width; i += 16) {
            const __mmask16 m = width - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - i)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(m, row + i);
            nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            const __mmask16 up = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ) |
                                 (_mm512_mask_cmp_ps_mask(m, v, best, _CMP_EQ_OQ) &
                                  _mm512_cmp_epi32_mask(at, _mm512_set1_epi32(width), _MM_CMPINT_EQ));
            best = _mm512_mask_mov_ps(best, up, v);
            at = _mm512_mask_mov_epi32(at, up, idx);
            idx = _mm512_add_epi32(idx, step);
        }
        if (nan) {  // the first NaN wins
            int64_t first = 0;
            while (!(row[first] != row[first])) first++;
            out[r] = first;
            continue;
        }
        const float top = _mm512_reduce_max_ps(best);
        const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
        const int first = _mm512_mask_reduce_min_epi32(holders, at);
        out[r] = first < width ? first : 0;  // a row of -inf only: its first element, as torch
    }
}

}  // namespace

extern "C" {

// Each entry point: 0, or 1 where it refuses its arguments; ``threads``: OpenMP threads to
// split the rows over (over_rows). x may be null (no residual add: the first layer's
// input norm).
#define KVT_NORM(suffix, T)                                                                  \
    int kvt_add_rmsnorm_##suffix(const T* x, int64_t xs, T* res, int64_t rs, const T* w,   \
                                 T* out, int64_t os, int rows, int width, float eps,        \
                                 int threads) {                                             \
        if (width < 8) return 1;                                                            \
        over_rows(rows, threads, [&](int a, int n) {                                        \
            add_rmsnorm(x ? x + a * xs : x, xs, res + a * rs, rs, w, out + a * os, os, n,   \
                        width, eps);                                                        \
        });                                                                                 \
        return 0;                                                                           \
    }
KVT_NORM(f32, float)
KVT_NORM(bf16, uint16_t)
#undef KVT_NORM

#define KVT_ROPE(name, suffix, T, C, max_d)                                                  \
    int kvt_##name##_##suffix(T* qkv, int64_t stride, int rows, int heads, int kv_heads,    \
                              int d, const int64_t* pos, const T* cos, const T* sin,        \
                              const int64_t* slots, C* k_cache, C* v_cache, int threads) {  \
        if (d % 2 != 0 || d > max_d) return 1;                                              \
        over_rows(rows, threads, [&](int a, int n) {                                        \
            name(qkv + a * stride, stride, n, heads, kv_heads, d, pos + a, cos, sin,        \
                 slots + a, k_cache, v_cache);                                              \
        });                                                                                 \
        return 0;                                                                           \
    }
KVT_ROPE(rope_kv, f32, float, float, 1 << 30)
KVT_ROPE(rope_kv, bf16, uint16_t, uint16_t, 1 << 30)
KVT_ROPE(rope_kv_int8, f32, float, int8_t, MAX_HEAD_DIM)
KVT_ROPE(rope_kv_int8, bf16, uint16_t, int8_t, MAX_HEAD_DIM)
#undef KVT_ROPE

#define KVT_SILU(suffix, T)                                                                  \
    int kvt_silu_mul_##suffix(const T* gu, int64_t is, T* out, int64_t os, int rows,        \
                              int width, int threads) {                                     \
        over_rows(rows, threads, [&](int a, int n) {                                        \
            silu_mul(gu + a * is, is, out + a * os, os, n, width);                          \
        });                                                                                 \
        return 0;                                                                           \
    }
KVT_SILU(f32, float)
KVT_SILU(bf16, uint16_t)
#undef KVT_SILU

// float32 rows only (the LM head's logits); ``out``: int64 indices.
int kvt_argmax_rows(const float* x, int64_t stride, int rows, int width, int64_t* out,
                    int threads) {
    if (width < 1) return 1;
    over_rows(rows, threads, [&](int a, int n) { argmax_rows(x + a * stride, stride, n, width, out + a); });
    return 0;
}

}  // extern "C"
