// AVX2 helpers shared by the native kernels (cpu_decode_avx2.cpp, cpu_gemm_avx2.cpp,
// cpu_fused.cpp and cpu_fused_avx2.cpp). The fused ops' sum_squares is exact only where
// built with -ffp-contract=off (a contracted multiply-add would round once where torch
// rounds twice).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace kvt_avx2 {

// e^x for 8 lanes: a Cephes-style float32 exp (range reduction by ln 2, degree-5
// polynomial) within ~2 ulp of expf; 0 below -87.3 (where expf underflows to denormals),
// inputs above 88.3 taken as 88.3 (e^88.3 ~ 2.1e38, still finite).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The float32 sum of squares of a row of n (>= 8) elements in the order of torch's float
// sum over a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum
// -> row_sum -> multi_row_sum), whose sum runs its AVX2 code on AVX-512 CPUs too:
// vectors of 8 in 4 interleaved accumulators with cascade levels, those 4 added, then
// the scalar tail, then the 8 lanes one by one.
inline __m256 squares8(const float* p) {
    __m256 v = _mm256_loadu_ps(p);
    return _mm256_mul_ps(v, v);
}
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

// (static: internal to each library, like the kernels in their anonymous namespaces)
template <typename T>
static inline float sum_squares(const T* h, int n) {
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

}  // namespace kvt_avx2
