// bfloat16 linear layers on AVX512-BF16 dot products (engine.kernels.cpu_gemm): out = x W^T
// for x [m, k] and W [n, k], both bfloat16, products summed in float32 by vdpbf16ps and the
// sums rounded to bfloat16 (round to nearest even), as oneDNN's bfloat16 matmul rounds.
//
// The weight is packed once into panels of NR 16-column vectors: panel p holds, for each
// pair of input values q (k / 2 of them), NR vectors of 16 columns' (W[c][2q], W[c][2q+1])
// pairs, the operand layout of vdpbf16ps. A micro-kernel keeps MR x NR float32 sums in
// registers and, per pair q, loads the panel's NR vectors once for MR rows (each row's pair
// broadcast from x). Threads split the panels (a panel, 55-150 KB at SmolLM2's widths,
// stays in L2 while every row passes it).
//
// Why: on a Zen 4 EPYC (AVX512-BF16, no AMX) torch's oneDNN bfloat16 matmul, packed weights
// and all, ran SmolLM2-135M's projections at 165-290 GFLOP/s on 16-64 rows (a fixed ~30 us
// a call on a 576 x 576 weight); this kernel, same run, 290-410: 1.2-1.9x faster at 16
// rows, 1.07-1.33x at 64, 1.05-1.19x at 512 (bench/cpu_gemm.py). Where oneDNN has AMX it
// multiplies far faster on large batches; the engine races the two at start-up
// (engine.model.native_linear).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int MR = 8;  // rows a micro-kernel keeps (MR x NR sums + NR weights in registers)
constexpr int NR = 3;  // 16-column vectors a panel holds (48 columns)

#ifdef __AVX512BF16__
template <int R, int V>
inline void micro(const uint16_t* x, int64_t ldx, const uint32_t* panel, int pairs, int stride,
                  uint16_t* out, int64_t ldo) {
    __m512 acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int q = 0; q < pairs; q++) {
        __m512bh w[V];
        for (int v = 0; v < V; v++)
            w[v] = (__m512bh)_mm512_load_si512(panel + (int64_t(q) * stride + v) * 16);
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * ldx + 2 * q, sizeof(pair));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(int(pair));
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * v),
                                (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
}

// All m rows against one panel of V vectors.
template <int V>
void panel_rows(const uint16_t* x, int64_t ldx, int m, const uint32_t* panel, int pairs,
                uint16_t* out, int64_t ldo) {
    int r = 0;
    for (; r + MR <= m; r += MR) micro<MR, V>(x + r * ldx, ldx, panel, pairs, V, out + r * ldo, ldo);
    x += r * ldx;
    out += r * ldo;
    switch (m - r) {
#define KVT_R(k) case k: micro<k, V>(x, ldx, panel, pairs, V, out, ldo); break;
        KVT_R(1) KVT_R(2) KVT_R(3) KVT_R(4) KVT_R(5) KVT_R(6) KVT_R(7)
#undef KVT_R
        default: break;
    }
}
#endif

#ifdef __AVX512VNNI__
// Int8 products (kvt_gemm_i8): MR x NR int32 sums; per quad q (4 input values) the panel's
// NR vectors hold 16 columns' 4 int8 weights each, every row's 4 uint8 inputs are broadcast
// and vpdpbusd adds the 4 products into each column's int32 sum (exact: |sum| < 2^31 for
// k < 2^16). The epilogue removes the inputs' +128 offset (comp = 128 x the column's weight
// sum), scales by row scale x column scale and rounds to bfloat16.
// acc + the 4-byte dot products of a (uint8) and w (int8). Inline assembly, not
// _mm512_dpbusd_epi32: GCC 12 keeps the intrinsic's 24 accumulators on the stack (a store
// after every vpdpbusd); with the plain register operand they stay in registers.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
    return acc;
}

template <int R, int V>
inline void micro_i8(const uint8_t* x, int64_t ldx, const uint32_t* panel, int quads,
                     const float* row_scale, const float* col_scale, const int32_t* comp,
                     uint16_t* out, int64_t ldo) {
    __m512i acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_si512();
    for (int q = 0; q < quads; q++) {
        __m512i w[V];
        for (int v = 0; v < V; v++) w[v] = _mm512_load_si512(panel + (int64_t(q) * V + v) * 16);
        for (int r = 0; r < R; r++) {
            uint32_t quad;
            memcpy(&quad, x + r * ldx + 4 * q, sizeof(quad));
            const __m512i a = _mm512_set1_epi32(int(quad));
            for (int v = 0; v < V; v++) acc[r][v] = dpbusd(acc[r][v], a, w[v]);
        }
    }
    for (int v = 0; v < V; v++) {
        const __m512i c = _mm512_loadu_si512(comp + 16 * v);
        const __m512 s = _mm512_loadu_ps(col_scale + 16 * v);
        for (int r = 0; r < R; r++) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], c));
            const __m512 y = _mm512_mul_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(row_scale[r])));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * v),
                                (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}

template <int V>
void panel_rows_i8(const uint8_t* x, int64_t ldx, int m, const uint32_t* panel, int quads,
                   const float* row_scale, const float* col_scale, const int32_t* comp,
                   uint16_t* out, int64_t ldo) {
    int r = 0;
    for (; r + MR <= m; r += MR)
        micro_i8<MR, V>(x + r * ldx, ldx, panel, quads, row_scale + r, col_scale, comp,
                        out + r * ldo, ldo);
    x += r * ldx;
    out += r * ldo;
    row_scale += r;
    switch (m - r) {
#define KVT_R(k) case k: micro_i8<k, V>(x, ldx, panel, quads, row_scale, col_scale, comp, out, ldo); break;
        KVT_R(1) KVT_R(2) KVT_R(3) KVT_R(4) KVT_R(5) KVT_R(6) KVT_R(7)
#undef KVT_R
        default: break;
    }
}

// Row x [k] bfloat16 (k % 16 == 0) to uint8 (round(x / scale) + 128, |.| <= 127) and its
// scale max|x| / 127 (0 for a zero row, whose values all become 128).
inline void quantize_row(const uint16_t* x, int k, uint8_t* q, float* scale) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float m = _mm512_reduce_max_ps(amax);
    *scale = m / 127.0f;
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127),
                  offset = _mm512_set1_epi32(128);
    for (int i = 0; i < k; i += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16));
        __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // round to nearest even
        n = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(n, lo), hi), offset);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(n));
    }
}
#endif

// Panel p's first vector and width (NR vectors, the last panel what is left).
inline int panel_vectors(int p, int vectors) { return vectors - p * NR < NR ? vectors - p * NR : NR; }

}  // namespace

extern "C" {

// Whether this build has the kernel (the compiler targeted AVX512-BF16).
int kvt_gemm_available() {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

// uint32 elements of the packed copy of an [n, k] weight (n a multiple of 16, k even).
int64_t kvt_gemm_packed_size(int n, int k) { return int64_t(n) * (k / 2); }

// W [n, k] (row stride k) into ``packed`` (kvt_gemm_packed_size elements, 64-byte
// aligned); 1 if n is not a multiple of 16 or k is odd, else 0.
int kvt_gemm_pack(const uint16_t* w, int n, int k, uint32_t* packed) {
    if (n % 16 != 0 || k % 2 != 0 || n <= 0 || k <= 0) return 1;
    const int vectors = n / 16, pairs = k / 2;
    const int panels = (vectors + NR - 1) / NR;
    uint32_t* dst = packed;
    for (int p = 0; p < panels; p++) {
        const int width = panel_vectors(p, vectors);
        for (int q = 0; q < pairs; q++)
            for (int v = 0; v < width; v++)
                for (int l = 0; l < 16; l++) {
                    const int64_t col = int64_t(p * NR + v) * 16 + l;
                    *dst++ = uint32_t(w[col * k + 2 * q]) | (uint32_t(w[col * k + 2 * q + 1]) << 16);
                }
    }
    return 0;
}

// out [m, n] (row stride ldo) = x [m, k] (row stride ldx) times the packed weight's
// transpose, on ``threads`` OpenMP threads; 1 if the build lacks the kernel or the shape
// cannot be packed, else 0.
int kvt_gemm(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed, int n, int k,
             uint16_t* out, int64_t ldo, int threads) {
#ifdef __AVX512BF16__
    if (n % 16 != 0 || k % 2 != 0 || m < 0) return 1;
    const int vectors = n / 16, pairs = k / 2;
    const int panels = (vectors + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < panels; p++) {
        const uint32_t* panel = packed + int64_t(p) * NR * 16 * pairs;
        uint16_t* o = out + int64_t(p) * NR * 16;
        switch (panel_vectors(p, vectors)) {
            case 1: panel_rows<1>(x, ldx, m, panel, pairs, o, ldo); break;
            case 2: panel_rows<2>(x, ldx, m, panel, pairs, o, ldo); break;
            default: panel_rows<NR>(x, ldx, m, panel, pairs, o, ldo); break;
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)packed; (void)n; (void)k; (void)out; (void)ldo; (void)threads;
    return 1;
#endif
}

// Whether this build has the int8 kernel (the compiler targeted AVX512-VNNI and -BF16).
int kvt_gemm_i8_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// W [n, k] int8 (row stride k; n % 16 == 0, k % 16 == 0) into ``packed`` (n * k / 4
// uint32, 64-byte aligned: panels of NR vectors, per quad of inputs 16 columns' 4 weights)
// and ``comp`` [n] = 128 x each column's weight sum; 1 if the shape cannot be packed.
int kvt_gemm_i8_pack(const int8_t* w, int n, int k, uint32_t* packed, int32_t* comp) {
    if (n % 16 != 0 || k % 16 != 0 || n <= 0 || k <= 0) return 1;
    const int vectors = n / 16, quads = k / 4;
    const int panels = (vectors + NR - 1) / NR;
    uint32_t* dst = packed;
    for (int p = 0; p < panels; p++) {
        const int width = panel_vectors(p, vectors);
        for (int q = 0; q < quads; q++)
            for (int v = 0; v < width; v++)
                for (int l = 0; l < 16; l++) {
                    const int8_t* src = w + (int64_t(p * NR + v) * 16 + l) * k + 4 * q;
                    uint32_t quad;
                    memcpy(&quad, src, sizeof(quad));
                    *dst++ = quad;
                }
    }
    for (int c = 0; c < n; c++) {
        int32_t sum = 0;
        for (int i = 0; i < k; i++) sum += w[int64_t(c) * k + i];
        comp[c] = 128 * sum;
    }
    return 0;
}

// out [m, n] bfloat16 (row stride ldo) = x [m, k] bfloat16 (row stride ldx), each row
// quantized to int8 with its own scale (so a row's result does not depend on its batch),
// times the packed int8 weight's transpose, scaled by ``col_scale`` [n]; ``scratch``
// holds m * k bytes and ``row_scale`` m floats. On ``threads`` OpenMP threads; 1 if the
// build lacks the kernel or the shape cannot be packed, else 0.
int kvt_gemm_i8(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed,
                const float* col_scale, const int32_t* comp, int n, int k, uint16_t* out,
                int64_t ldo, uint8_t* scratch, float* row_scale, int threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    if (n % 16 != 0 || k % 16 != 0 || m < 0) return 1;
    const int vectors = n / 16, quads = k / 4;
    const int panels = (vectors + NR - 1) / NR;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) quantize_row(x + r * ldx, k, scratch + int64_t(r) * k, row_scale + r);
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint32_t* panel = packed + int64_t(p) * NR * 16 * quads;
            const int64_t c0 = int64_t(p) * NR * 16;
            uint16_t* o = out + c0;
            switch (panel_vectors(p, vectors)) {
                case 1: panel_rows_i8<1>(scratch, k, m, panel, quads, row_scale, col_scale + c0, comp + c0, o, ldo); break;
                case 2: panel_rows_i8<2>(scratch, k, m, panel, quads, row_scale, col_scale + c0, comp + c0, o, ldo); break;
                default: panel_rows_i8<NR>(scratch, k, m, panel, quads, row_scale, col_scale + c0, comp + c0, o, ldo); break;
            }
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)packed; (void)col_scale; (void)comp; (void)n; (void)k;
    (void)out; (void)ldo; (void)scratch; (void)row_scale; (void)threads;
    return 1;
#endif
}

}  // extern "C"
