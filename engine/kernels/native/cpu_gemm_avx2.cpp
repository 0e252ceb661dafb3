// Int8 linear layers on CPUs with AVX2 but no int8 dot products (engine.kernels.cpu_gemm_avx2):
// out = x W^T for x [m, k] float32 and W [n, k] quantized per output channel to int8
// (scale = max |w| / 127 of its row), each input row quantized to int16 with its own scale
// inside the call, products summed exactly in int32 by vpmaddwd (16 multiply-adds an
// instruction, FMA's 8), the sums scaled by row scale x column scale into float32.
//
// Why int16 inputs: without VNNI the int8 route left is vpmaddubsw (uint8 x int8, pairs
// summed in int16), which saturates on full-range inputs; torch's fbgemm therefore cuts
// inputs to 7 bits there, and on an AVX2-only EPYC its greedy answers shared 3 of 64 with
// the float32 model's. int16 inputs keep ~14-15 bits of each row (1 part in 10^4 of its
// largest value), so the weights' int8 rounding is the only coarse step.
//
// Exactness: a row's inputs are rounded to at most qmax = min(32767, (2^31 - 1) / (127 k))
// in magnitude, so no int32 sum over k products of |w| <= 127 can overflow; each sum is
// exact and independent of summation order. A row's result does not depend on the rows
// beside it or on the thread count (batch-invariant).
//
// Layout: the weight is packed once into panels of V = 2 vectors of 8 columns; for each
// pair of inputs, a vector's 8 columns' two int8 weights (16 bytes), widened to int16 as
// they are loaded. A micro-kernel keeps R x V int32 sums in registers and per pair
// broadcasts each row's two int16 inputs. Threads split the panels; rows pass in chunks
// that stay in L2 while the panels stream. A "paired" weight (a gate and an up projection
// stacked) holds 8 gate and the matching 8 up columns in each panel, so the epilogue can
// write SiLU(gate) * up instead of the 2I-wide product (cpu_gemm.cpp's pairing, in
// 8-column halves).
#include <immintrin.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "cpu_avx2.h"

namespace {

// The largest int16 magnitude an input row of k values is rounded to (module comment).
inline int qmax_for(int k) {
    const int64_t bound = k > 0 ? int64_t(INT_MAX) / (int64_t(127) * k) : 32767;
    return bound < 32767 ? int(bound) : 32767;
}

constexpr int V = 2;   // 8-column vectors a panel holds (16 columns)
constexpr int MR = 6;  // rows a micro-kernel keeps: 12 sums, 2 weights, a broadcast, a temporary
constexpr int64_t CHUNK_BYTES = 192 * 1024;  // quantized rows a pass over the panels takes

#ifdef __AVX2__
// acc + the pair sums of a x w (vpmaddwd, then vpaddd through a temporary).
inline __m256i madd(__m256i acc, __m256i a, __m256i w) {
    __m256i t;
    asm("vpmaddwd %[w], %[a], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
        : [acc] "+x"(acc), [t] "=&x"(t)
        : [a] "x"(a), [w] "x"(w));
    return acc;
}

// x's pair of int16 broadcast, made after ``after`` (this step's weights: a register the
// compiler must have loaded first, so each broadcast stays beside its products). GCC 12
// otherwise hoists all rows' broadcasts above the products, runs out of the 16 registers
// and keeps the sums on the stack (2.3x slower).
inline __m256i broadcast_after(const int16_t* x, __m256i after) {
    __m256i a;
    asm("vpbroadcastd %[x], %[a]" : [a] "=x"(a) : [x] "m"(*reinterpret_cast<const int32_t*>(x)), "x"(after));
    return a;
}

// A panel: its packed data and the output columns of its two 8-column vectors.
struct Panel {
    const int8_t* data;
    int64_t col[V];
};

// Panel p of an n-column weight k deep: plain, columns 16p .. 16p + 15; paired (a gate
// and an up projection stacked as [2I, k]), gate columns 8p .. 8p + 7 and the up
// columns I + 8p .. I + 8p + 7, so one panel holds both halves of 8 SwiGLU outputs.
inline Panel panel_of(const int8_t* packed, int p, int n, int k, bool paired) {
    Panel pn{packed + int64_t(p) * 16 * k, {}};
    pn.col[0] = paired ? int64_t(p) * 8 : int64_t(p) * 16;
    pn.col[1] = paired ? int64_t(n / 2) + int64_t(p) * 8 : int64_t(p) * 16 + 8;
    return pn;
}

// ---- epilogues: what a micro-kernel does with a row's two vectors of int32 sums ----

// The sums of the 8 columns from ``col`` times row scale x column scale.
inline __m256 dequantize(__m256i sums, const float* col_scale, int64_t col, __m256 row_scale) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(_mm256_loadu_ps(col_scale + col), row_scale));
}

// Each vector to its own output columns.
struct Plain {
    float* out;
    int64_t ldo;
    const float* row_scale;
    const float* col_scale;
    void operator()(int r, __m256i s0, __m256i s1, const int64_t* col) const {
        const __m256 rs = _mm256_set1_ps(row_scale[r]);
        _mm256_storeu_ps(out + r * ldo + col[0], dequantize(s0, col_scale, col[0], rs));
        _mm256_storeu_ps(out + r * ldo + col[1], dequantize(s1, col_scale, col[1], rs));
    }
};

// A paired panel's gate g and up u to g / (1 + e^-g) * u at the gate's columns of an
// [m, I] output (float32, exp within ~2 ulp: close to torch's SiLU, not bit-equal).
struct SiluMul {
    float* out;
    int64_t ldo;
    const float* row_scale;
    const float* col_scale;
    void operator()(int r, __m256i s0, __m256i s1, const int64_t* col) const {
        const __m256 rs = _mm256_set1_ps(row_scale[r]);
        const __m256 g = dequantize(s0, col_scale, col[0], rs), u = dequantize(s1, col_scale, col[1], rs);
        const __m256 e = kvt_avx2::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + r * ldo + col[0], _mm256_mul_ps(act, u));
    }
};

// Rows r0 .. r0 + R - 1 (xq: their int16 inputs, k apart) against one panel.
template <int R, typename Epi>
inline void micro(const int16_t* xq, int k, const Panel& pn, int r0, const Epi& epi) {
    __m256i acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm256_setzero_si256();
    const int pairs = k / 2;
    for (int q = 0; q < pairs; q++) {
        __m256i w[V];
        for (int v = 0; v < V; v++)
            w[v] = _mm256_cvtepi8_epi16(
                _mm_load_si128(reinterpret_cast<const __m128i*>(pn.data + (int64_t(q) * V + v) * 16)));
        for (int r = 0; r < R; r++) {
            const __m256i a = broadcast_after(xq + int64_t(r) * k + 2 * q, w[V - 1]);
            for (int v = 0; v < V; v++) acc[r][v] = madd(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < R; r++) epi(r0 + r, acc[r][0], acc[r][1], pn.col);
}

// micro<MR> with the sums in named registers: GCC 12 keeps an array of 12 sums in
// memory (a store of each after every step), these it keeps in registers.
template <typename Epi>
inline void micro6(const int16_t* xq, int k, const Panel& pn, int r0, const Epi& epi) {
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00,
            s30 = s00, s31 = s00, s40 = s00, s41 = s00, s50 = s00, s51 = s00;
    const int pairs = k / 2;
    const int16_t* x = xq;
    for (int q = 0; q < pairs; q++, x += 2) {
        const __m128i* wp = reinterpret_cast<const __m128i*>(pn.data + int64_t(q) * V * 16);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_load_si128(wp));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_load_si128(wp + 1));
        __m256i a = broadcast_after(x, w1);
        s00 = madd(s00, a, w0);
        s01 = madd(s01, a, w1);
        a = broadcast_after(x + k, w1);
        s10 = madd(s10, a, w0);
        s11 = madd(s11, a, w1);
        a = broadcast_after(x + 2 * int64_t(k), w1);
        s20 = madd(s20, a, w0);
        s21 = madd(s21, a, w1);
        a = broadcast_after(x + 3 * int64_t(k), w1);
        s30 = madd(s30, a, w0);
        s31 = madd(s31, a, w1);
        a = broadcast_after(x + 4 * int64_t(k), w1);
        s40 = madd(s40, a, w0);
        s41 = madd(s41, a, w1);
        a = broadcast_after(x + 5 * int64_t(k), w1);
        s50 = madd(s50, a, w0);
        s51 = madd(s51, a, w1);
    }
    epi(r0, s00, s01, pn.col);
    epi(r0 + 1, s10, s11, pn.col);
    epi(r0 + 2, s20, s21, pn.col);
    epi(r0 + 3, s30, s31, pn.col);
    epi(r0 + 4, s40, s41, pn.col);
    epi(r0 + 5, s50, s51, pn.col);
}

// Rows r0 .. r0 + m - 1 of the call (xq: their int16 inputs) against one panel.
template <typename Epi>
void panel_rows(const int16_t* xq, int k, int m, const Panel& pn, int r0, const Epi& epi) {
    int r = 0;
    for (; r + MR <= m; r += MR) micro6(xq + int64_t(r) * k, k, pn, r0 + r, epi);
    xq += int64_t(r) * k;
    r0 += r;
    switch (m - r) {
        case 1: micro<1>(xq, k, pn, r0, epi); break;
        case 2: micro<2>(xq, k, pn, r0, epi); break;
        case 3: micro<3>(xq, k, pn, r0, epi); break;
        case 4: micro<4>(xq, k, pn, r0, epi); break;
        case 5: micro<5>(xq, k, pn, r0, epi); break;
        default: break;
    }
}

// Row x [k] float32 (k % 16 == 0) to int16 (round(x / scale), |.| <= qmax) and its scale
// max |x| / qmax (0 for a zero row, whose values all become 0).
inline void quantize_row(const float* x, int k, int qmax, int16_t* q, float* scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float m = 0.0f;
    for (float v : lanes) m = v > m ? v : m;
    *scale = m / float(qmax);
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? float(qmax) / m : 0.0f);
    const __m256i lo = _mm256_set1_epi32(-qmax), hi = _mm256_set1_epi32(qmax);
    for (int i = 0; i < k; i += 16) {
        // round to nearest even; a product can land one past qmax: clamp
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
        a = _mm256_min_epi32(_mm256_max_epi32(a, lo), hi);
        b = _mm256_min_epi32(_mm256_max_epi32(b, lo), hi);
        // packs works within 128-bit lanes: restore the order
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), packed);
    }
}

// All m rows against every panel through ``epi``: rows quantized first, then passed in
// chunks that stay in L2 while the threads split the panels.
template <typename Epi>
void gemm(const float* x, int64_t ldx, int m, const int8_t* packed, int n, int k, bool paired,
          int16_t* scratch, float* row_scale, int threads, const Epi& epi) {
    const int qmax = qmax_for(k);
    const int panels = n / 16;
    int chunk = int(CHUNK_BYTES / (2 * int64_t(k)));
    chunk = chunk < MR ? MR : chunk - chunk % MR;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) quantize_row(x + r * ldx, k, qmax, scratch + int64_t(r) * k, row_scale + r);
        for (int c0 = 0; c0 < m; c0 += chunk) {
            const int rows = m - c0 < chunk ? m - c0 : chunk;
#pragma omp for schedule(static)
            for (int p = 0; p < panels; p++)
                panel_rows(scratch + int64_t(c0) * k, k, rows, panel_of(packed, p, n, k, paired), c0, epi);
        }
    }
}
#endif

inline bool packable(int n, int k) { return n > 0 && k > 0 && n % 16 == 0 && k % 16 == 0; }

}  // namespace

extern "C" {

// Whether this build has the kernel (the compiler targeted AVX2).
int kvt_gemm_avx2_available() {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

// The largest int16 magnitude an input row of k values is rounded to (module comment).
int kvt_gemm_avx2_qmax(int k) { return qmax_for(k); }

// W [n, k] int8 (row stride k; n % 16 == 0, k % 16 == 0) into ``packed`` (n * k bytes,
// 16-byte aligned): panel after panel (panel_of: plain or paired), per pair of inputs
// two vectors of 8 columns x 2 weights. 1 if the shape cannot be packed, else 0.
int kvt_gemm_avx2_pack(const int8_t* w, int n, int k, int paired, int8_t* packed) {
    if (!packable(n, k)) return 1;
    for (int p = 0; p < n / 16; p++) {
        const Panel pn = panel_of(nullptr, p, n, k, paired);
        for (int q = 0; q < k / 2; q++)
            for (int v = 0; v < V; v++)
                for (int c = 0; c < 8; c++) {
                    const int64_t col = pn.col[v] + c;
                    *packed++ = w[col * k + 2 * q];
                    *packed++ = w[col * k + 2 * q + 1];
                }
    }
    return 0;
}

// out (row stride ldo) from x [m, k] float32 (row stride ldx), each row quantized to
// int16 with its own scale, times the packed weight's transpose, scaled by ``col_scale``
// [n]: [m, n] float32, or with ``silu`` (paired weights only) [m, n / 2] = SiLU(gate) *
// up. ``scratch`` holds m * k int16 and ``row_scale`` m floats. On ``threads`` OpenMP
// threads. 1 if the build lacks the kernel or the arguments do not fit, else 0.
int kvt_gemm_avx2(const float* x, int64_t ldx, int m, const int8_t* packed, const float* col_scale,
                  int n, int k, int paired, int silu, float* out, int64_t ldo, int16_t* scratch,
                  float* row_scale, int threads) {
#ifdef __AVX2__
    if (!packable(n, k) || m < 0 || (silu && !paired)) return 1;
    if (silu)
        gemm(x, ldx, m, packed, n, k, true, scratch, row_scale, threads, SiluMul{out, ldo, row_scale, col_scale});
    else
        gemm(x, ldx, m, packed, n, k, paired, scratch, row_scale, threads, Plain{out, ldo, row_scale, col_scale});
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)packed; (void)col_scale; (void)n; (void)k; (void)paired;
    (void)silu; (void)out; (void)ldo; (void)scratch; (void)row_scale; (void)threads;
    return 1;
#endif
}

}  // extern "C"
