// The Llama decoder's small per-layer ops, fused, for x86-64 CPUs with AVX2 and FMA but
// no AVX-512: cpu_fused.cpp's kernels (its header says what each computes and where it
// rounds) in 8-lane vectors, with the same entry points (cpu_fused_api.h). Built with
// -ffp-contract=off; loaded by engine/kernels/cpu_fused.py where the AVX-512 build is
// unavailable.
//
// On such a CPU torch runs its AVX2 kernels, so the places where the order or the
// algorithm is torch's own follow those: RMSNorm's sum of squares is the AVX2 sum order
// cpu_fused.cpp already copies (kvt_avx2::sum_squares), exp() is SLEEF's expf_u10 in 8
// lanes (torch's AVX2 Vectorized<float>::exp, exp8 below), and SiLU's vector code runs in
// steps of two 8-lane vectors (16 float32 or 32 bfloat16 elements), std::exp on the rest.
// So the results are the eager ops' bit for bit (tests/engine/kernels/test_cpu_fused.py).
//
// Layout: rows of `width` elements with a row stride in elements; bfloat16 as uint16 bits.
// A vector's tail (fewer than 8 elements left) is read into and written from a small
// buffer, the lanes past it zero and unused.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_avx2.h"

namespace {

using kvt_avx2::sum_squares;

// ---- 8 lanes of float32 or bfloat16 (c10::BFloat16's round to nearest even) ----

inline __m256 widen8(const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

// The n (>= 1) elements from p, as float32 lanes (the lanes past n zero).
template <typename T>
inline __m256 load(const T* p, int n) {
    if (n >= 8) return widen8(p);
    T tail[8] = {};
    memcpy(tail, p, sizeof(T) * n);
    return widen8(tail);
}

inline void store8(uint16_t* p, __m256 x) {  // x already rounded
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }

// The first n (>= 1) lanes of x to p.
template <typename T>
inline void store(T* p, __m256 x, int n) {
    if (n >= 8) return store8(p, x);
    T tail[8];
    store8(tail, x);
    memcpy(p, tail, sizeof(T) * n);
}

inline __m256 round_bf16(__m256 x) {  // float32 -> nearest bfloat16, as a float32
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u)));
    const __m256 ordered = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_castsi256_ps(r), ordered);
}
inline __m256 round_to(const uint16_t*, __m256 x) { return round_bf16(x); }
inline __m256 round_to(const float*, __m256 x) { return x; }

// e^x as torch computes it on AVX2 (Vectorized<float>::exp is SLEEF's expf u10 in 8
// lanes, sleefsimdsp.c xexpf): kvt_simd::exp16's steps, lane for lane.
inline __m256 exp8(__m256 d) {
    const __m256i q = _mm256_cvtps_epi32(
        _mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i half = _mm256_srai_epi32(q, 1);  // u * 2^(q/2) * 2^(q - q/2)
    auto pow2 = [](__m256i e) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(0x7f)), 23));
    };
    u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half)), pow2(_mm256_sub_epi32(q, half)));
    u = _mm256_and_ps(u, _mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_NLT_US));
    return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

template <typename T>
void add_rmsnorm(const T* x, int64_t x_stride, T* res, int64_t res_stride, const T* weight,
                 T* out, int64_t out_stride, int rows, int width, float eps) {
    for (int r = 0; r < rows; r++) {
        T* h = res + r * res_stride;
        if (x != nullptr) {
            for (int i = 0; i < width; i += 8) {
                const int n = width - i;
                store(h + i, round_to(h, _mm256_add_ps(load(h + i, n), load(x + r * x_stride + i, n))), n);
            }
        }
        const float var = sum_squares(h, width) / float(width);
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(var + eps));
        T* o = out + r * out_stride;
        for (int i = 0; i < width; i += 8) {
            const int n = width - i;
            const __m256 normed = round_to(h, _mm256_mul_ps(load(h + i, n), inv));
            store(o + i, round_to(h, _mm256_mul_ps(load(weight + i, n), normed)), n);
        }
    }
}

// One head of d elements (d even) rotated by a position's cos/sin rows.
template <typename T>
inline void rotate_head(const T* src, const T* cos, const T* sin, int d, T* dst) {
    const int half = d / 2;
    for (int i = 0; i < half; i += 8) {
        const int n = half - i;
        const __m256 lo = load(src + i, n), hi = load(src + half + i, n);
        const __m256 c_lo = load(cos + i, n), c_hi = load(cos + half + i, n);
        const __m256 s_lo = load(sin + i, n), s_hi = load(sin + half + i, n);
        // out[i] = q[i] cos[i] - q[i+half] sin[i];  out[i+half] = q[i+half] cos + q[i] sin
        const __m256 a = round_to(src, _mm256_mul_ps(lo, c_lo));
        const __m256 b = round_to(src, _mm256_mul_ps(hi, s_lo));
        const __m256 c = round_to(src, _mm256_mul_ps(hi, c_hi));
        const __m256 e = round_to(src, _mm256_mul_ps(lo, s_hi));
        store(dst + i, round_to(src, _mm256_sub_ps(a, b)), n);
        store(dst + half + i, round_to(src, _mm256_add_ps(c, e)), n);
    }
}

template <typename T>
inline void copy_head(const T* src, int d, T* dst) {
    memcpy(dst, src, sizeof(T) * d);
}

// One head's int8 cache row (cpu_fused_rows.h: layout and rounding).
inline void quantize_head(const float* x, int d, int8_t* dst) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 most = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) most = _mm256_max_ps(most, _mm256_andnot_ps(sign, load(x + i, d - i)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most);
    float amax = 0.0f;
    for (float v : lanes) amax = v > amax ? v : amax;
    const float scale = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = 0; i < d; i += 8) {
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load(x + i, d - i), inv));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        alignas(16) int8_t bytes[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes), _mm_packs_epi16(words, words));
        memcpy(dst + i, bytes, d - i < 8 ? d - i : 8);
    }
    memcpy(dst + d, &scale, sizeof(scale));
}

template <typename T>
inline void widen_head(const T* src, int d, float* dst) {
    for (int i = 0; i < d; i += 8) store(dst + i, load(src + i, d - i), d - i);
}

#include "cpu_fused_rows.h"  // rope_rows, rope_kv, rope_kv_int8 over the helpers above

// torch's SiLU on AVX2 runs its vector code over each contiguous run of elements in steps
// of two vectors (16 float32 or 32 bfloat16 lanes) and its scalar code (std::exp) on the rest.
inline int vector_part(const float*, int n) { return n - n % 16; }
inline int vector_part(const uint16_t*, int n) { return n - n % 32; }

template <typename T>
void silu_mul(const T* gate_up, int64_t in_stride, T* out, int64_t out_stride, int rows,
              int width) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const int vec_end = vector_part(gate_up, width);
    for (int r = 0; r < rows; r++) {
        const T* g = gate_up + r * in_stride;
        const T* u = g + width;
        T* o = out + r * out_stride;
        for (int i = 0; i < width; i += 8) {
            const int n = width - i;
            const __m256 gv = load(g + i, n);
            __m256 e;
            if (i < vec_end) {
                e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            } else {  // the scalar tail: std::exp
                alignas(32) float x[8];
                _mm256_store_ps(x, gv);
                for (int k = 0; k < 8; k++) x[k] = expf(-x[k]);
                e = _mm256_load_ps(x);
            }
            const __m256 act = round_to(g, _mm256_div_ps(gv, _mm256_add_ps(one, e)));
            store(o + i, round_to(g, _mm256_mul_ps(act, load(u + i, n))), n);
        }
    }
}

// cpu_fused.cpp's argmax_rows in 8 lanes: lane l keeps the largest value of elements l,
// l + 8, ... and the first index it came from; the row's answer is the smallest index
// among the lanes holding the row's maximum (the first NaN where a row has one).
void argmax_rows(const float* x, int64_t stride, int rows, int width, int64_t* out) {
    const __m256i none = _mm256_set1_epi32(width);  // no element yet (an all -inf row)
    for (int r = 0; r < rows; r++) {
        const float* row = x + r * stride;
        __m256 best = _mm256_set1_ps(-INFINITY);
        __m256i at = none;
        __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(8);
        int nan = 0;
        for (int i = 0; i < width; i += 8) {
            const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(none, idx));
            const __m256 v = load(row + i, width - i);
            nan |= _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), valid));
            const __m256 empty = _mm256_castsi256_ps(_mm256_cmpeq_epi32(at, none));
            const __m256 up = _mm256_and_ps(
                valid, _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                                    _mm256_and_ps(_mm256_cmp_ps(v, best, _CMP_EQ_OQ), empty)));
            best = _mm256_blendv_ps(best, v, up);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), up));
            idx = _mm256_add_epi32(idx, step);
        }
        if (nan) {  // the first NaN wins
            int64_t first = 0;
            while (!(row[first] != row[first])) first++;
            out[r] = first;
            continue;
        }
        alignas(32) float top[8];
        alignas(32) int32_t from[8];
        _mm256_store_ps(top, best);
        _mm256_store_si256(reinterpret_cast<__m256i*>(from), at);
        float most = top[0];
        for (int l = 1; l < 8; l++) most = top[l] > most ? top[l] : most;
        int first = width;
        for (int l = 0; l < 8; l++)
            if (top[l] == most && from[l] < first) first = from[l];
        out[r] = first < width ? first : 0;  // a row of -inf only: its first element, as torch
    }
}

}  // namespace

#include "cpu_fused_api.h"  // the entry points
