// AVX-512 helpers shared by the native kernels (cpu_fused.cpp, cpu_gemm.cpp), where both
// must compute the same float32 values bit for bit. Build with -ffp-contract=off: a
// contracted multiply-add would round once where torch rounds twice. And the AMX tiles'
// set-up shared by cpu_gemm.cpp and cpu_attention.cpp.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifdef __AMX_TILE__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvt_simd {

inline __m512 round_bf16(__m512 x) {  // float32 -> nearest bfloat16, as a float32
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u)));
    __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    return _mm512_mask_blend_ps(ordered, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)),
                                _mm512_castsi512_ps(r));
}

// e^x exactly as torch computes it on AVX-512 (Vectorized<float>::exp is SLEEF's
// expf u10, sleefsimdsp.c xexpf): Cody-Waite reduction by ln 2, a degree-6 polynomial in
// FMAs, the scaling in two exact halves; 0 below -104, +inf above 100.
inline __m512 exp16(__m512 d) {
    const __m512i q = _mm512_cvt_roundps_epi32(
        _mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i half = _mm512_srai_epi32(q, 1);  // u * 2^(q/2) * 2^(q - q/2)
    auto pow2 = [](__m512i e) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(0x7f)), 23));
    };
    u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(half)), pow2(_mm512_sub_epi32(q, half)));
    u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_US), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ),
                              _mm512_set1_ps(INFINITY));
}

#ifdef __AMX_TILE__
struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Loads a configuration of all eight tiles, 64 bytes a row (16 float32 or int32 sums, 32
// bfloat16 or 64 int8 inputs): tiles below ``block_tiles`` ``block_rows`` rows (a
// partial block's C and A tiles), the rest 16.
inline void configure_tiles(int block_rows, int block_tiles) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = uint8_t(t < block_tiles ? block_rows : 16);
    }
    _tile_loadconfig(&cfg);
}

// Asks the kernel for this process's AMX tile state (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); true once granted.
inline bool amx_permitted() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

}  // namespace kvt_simd
