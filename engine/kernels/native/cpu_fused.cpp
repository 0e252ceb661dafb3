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

#include "cpu_avx2.h"
#include "cpu_simd.h"

namespace {

using kvt_avx2::sum_squares;
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

// One head's int8 cache row (cpu_fused_rows.h: layout and rounding).
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

#include "cpu_fused_rows.h"  // rope_rows, rope_kv, rope_kv_int8 over the helpers above

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

#include "cpu_fused_api.h"  // the entry points
