// Linear layers on AVX-512 dot products (engine.kernels.cpu_gemm): out = x W^T for x
// [m, k] bfloat16 and W [n, k], either
//
//   * bfloat16 (kvt_gemm): products summed in float32 by vdpbf16ps, or
//   * int8 per output channel (kvt_gemm_i8): each input row quantized to int8 with its
//     own scale (max |x| / 127) inside the call, products summed exactly in int32 by
//     vpdpbusd (64 multiply-adds an instruction, vdpbf16ps's 32, at the same rate), the
//     sums scaled by row scale x column scale;
//
// the float32 sums rounded to bfloat16 (round to nearest even, as oneDNN rounds).
//
// The weight is packed once into panels of up to NR 16-column vectors: panel p holds, for
// each unit of input values (a pair for bfloat16, a quad for int8), its vectors' 16
// columns' units, the operand layout of the dot-product instruction. A micro-kernel keeps
// R x V float32 / int32 sums in registers and, per unit, loads the panel's V vectors once
// for R rows (each row's unit broadcast from x). Threads split the panels (a panel, 28-150
// KB at SmolLM2's widths, stays near the core while every row passes it). A row's sums run
// over its inputs in one order whatever rows share the call: results are batch-invariant.
//
// Two layouts: "plain" (panel p: vectors NR*p, NR*p+1, ...) and "paired", for a gate and
// up projection stacked as [2I, k]: panel p holds gate columns 16p.. and up columns
// I+16p.., so one panel has both halves of 16 SwiGLU outputs and the epilogue can write
// bf(bf(g / (1 + exp(-g))) * u) (g and u the bfloat16-rounded sums) instead of the
// 2I-wide product: exactly what engine/kernels/native/cpu_fused.cpp's silu_mul computes
// from the stored product, without writing and re-reading it.
//
// Why: on a Zen 4 EPYC (AVX512-BF16/VNNI, no AMX) torch's oneDNN bfloat16 matmul ran
// SmolLM2-135M's projections at 165-290 GFLOP/s on 16-64 rows; the bfloat16 kernel,
// same run, 290-410, and the int8 one 620-830 GOP/s (bench/cpu_gemm.py). Where oneDNN has
// AMX it multiplies far faster on large batches; the engine races the two at start-up
// (engine.model.native_linear).
//
// AMX (kvt_gemm with amx=1, where the build targets AMX-BF16 and the kernel grants the
// process the tile state): the same panels feed the tiles as they are. A B tile is 16
// pairs (32 input values) x 16 columns, the panel's vector at stride V x 64 bytes; an A
// tile is 16 rows x 32 inputs of x in place; V float32 C tiles sum a 16-row block of one
// panel, pair after pair as vdpbf16ps does, then run through the same epilogues. A
// block of fewer rows loads a tile configuration of that many. On a 2-core Xeon with AMX
// the AVX-512 kernel ran the projections at ~200 GFLOP/s, oneDNN's AMX matmul at 500-1300:
// decode rows there are the tiles' work.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVT_AMX 1
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define KVT_AMX_I8 1
#endif
#endif

#include "cpu_simd.h"

namespace {

constexpr int NR = 3;  // 16-column vectors a plain panel holds (48 columns)

// Rows a micro-kernel keeps: R x V sums + V weights + a broadcast in 32 registers.
template <int V>
constexpr int rows_for() {
    return V == 2 ? 12 : 8;
}

// A panel: its packed data, its vectors and where each sits among the output columns.
struct Panel {
    const uint32_t* data;
    int vectors;
    int64_t col[NR];
};

inline int panel_count(int vectors, bool paired) { return paired ? vectors / 2 : (vectors + NR - 1) / NR; }

// Panel p of a weight of ``vectors`` 16-column vectors, ``units`` units deep.
inline Panel panel_of(const uint32_t* packed, int p, int vectors, int units, bool paired) {
    Panel pn{};
    if (paired) {
        pn.data = packed + int64_t(p) * 2 * 16 * units;
        pn.vectors = 2;
        pn.col[0] = int64_t(p) * 16;                    // gate
        pn.col[1] = int64_t(vectors / 2 + p) * 16;      // up
    } else {
        pn.data = packed + int64_t(p) * NR * 16 * units;
        pn.vectors = vectors - p * NR < NR ? vectors - p * NR : NR;
        for (int v = 0; v < pn.vectors; v++) pn.col[v] = int64_t(p * NR + v) * 16;
    }
    return pn;
}

// Lays out n columns' units (fetch(column, unit)) panel by panel.
template <typename Fetch>
void pack_layout(int n, int units, bool paired, uint32_t* dst, Fetch fetch) {
    const int vectors = n / 16;
    for (int p = 0; p < panel_count(vectors, paired); p++) {
        const Panel pn = panel_of(nullptr, p, vectors, units, paired);
        for (int q = 0; q < units; q++)
            for (int v = 0; v < pn.vectors; v++)
                for (int l = 0; l < 16; l++) *dst++ = fetch(pn.col[v] + l, q);
    }
}

inline bool packable(int n, int k, int k_multiple, bool paired) {
    return n > 0 && k > 0 && n % (paired ? 32 : 16) == 0 && k % k_multiple == 0;
}

// ---- epilogues: what a micro-kernel does with a row's V float32 sum vectors ----

inline __m256i to_bf16(__m512 y) { return (__m256i)_mm512_cvtneps_pbh(y); }

// Each vector to its own output columns.
struct Plain {
    uint16_t* out;
    int64_t ldo;
    template <int V>
    void operator()(int r, const __m512 (&y)[V], const int64_t* col) const {
        for (int v = 0; v < V; v++)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + col[v]), to_bf16(y[v]));
    }
};

// A paired panel's gate and up sums to SiLU(gate) * up at the gate's columns of an
// [m, I] output, rounding where the stored product and cpu_fused.cpp's silu_mul round.
struct SiluMul {
    uint16_t* out;
    int64_t ldo;
    template <int V>
    void operator()(int r, const __m512 (&y)[V], const int64_t* col) const {
        if constexpr (V == 2) {
            auto widen = [](__m256i b) {
                return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            };
            const __m512 g = widen(to_bf16(y[0])), u = widen(to_bf16(y[1]));
            const __m512 e = kvt_simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 act = kvt_simd::round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            const __m512 o = kvt_simd::round_bf16(_mm512_mul_ps(act, u));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + col[0]),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(o), 16)));
        }
    }
};

#ifdef __AVX512BF16__
// Rows r0 .. r0 + R - 1 of x (x points at row r0) against one panel of V vectors.
template <int R, int V, typename Epi>
inline void micro(const uint16_t* x, int64_t ldx, const Panel& pn, int pairs, int r0, const Epi& epi) {
    __m512 acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int q = 0; q < pairs; q++) {
        __m512bh w[V];
        for (int v = 0; v < V; v++)
            w[v] = (__m512bh)_mm512_load_si512(pn.data + (int64_t(q) * V + v) * 16);
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * ldx + 2 * q, sizeof(pair));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(int(pair));
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < R; r++) epi(r0 + r, acc[r], pn.col);
}

// All m rows against one panel of V vectors.
template <int V, typename Epi>
void panel_rows(const uint16_t* x, int64_t ldx, int m, const Panel& pn, int pairs, const Epi& epi) {
    constexpr int MR = rows_for<V>();
    int r = 0;
    for (; r + MR <= m; r += MR) micro<MR, V>(x + r * ldx, ldx, pn, pairs, r, epi);
    x += r * ldx;
    switch (m - r) {
#define KVT_R(k) case k: if constexpr (k < MR) micro<k, V>(x, ldx, pn, pairs, r, epi); break;
        KVT_R(1) KVT_R(2) KVT_R(3) KVT_R(4) KVT_R(5) KVT_R(6) KVT_R(7) KVT_R(8) KVT_R(9)
        KVT_R(10) KVT_R(11)
#undef KVT_R
        default: break;
    }
}

template <typename Epi>
void gemm_bf16(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed, int n, int pairs,
               bool paired, const Epi& epi, int threads) {
    const int vectors = n / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < panel_count(vectors, paired); p++) {
        const Panel pn = panel_of(packed, p, vectors, pairs, paired);
        switch (pn.vectors) {
            case 1: panel_rows<1>(x, ldx, m, pn, pairs, epi); break;
            case 2: panel_rows<2>(x, ldx, m, pn, pairs, epi); break;
            default: panel_rows<NR>(x, ldx, m, pn, pairs, epi); break;
        }
    }
}
#endif

#ifdef KVT_AMX
// Tiles: 0..2 the C sums of a panel's vectors, 3 the A rows, 4..6 the B vectors. (Two
// row blocks a pass, each B vector loaded once for both, measured no faster here.)
inline void amx_configure(int rows) { kvt_simd::configure_tiles(rows, 4); }

// Tile c += tile a x tile b, int8 (tdpbusd: uint8 rows, int8 weights) where ``Int8``, else
// bfloat16 (tdpbf16ps). A macro: GCC's tile intrinsics paste their tile numbers into the
// instruction's text, so they take literals only.
#ifdef KVT_AMX_I8
#define KVT_TILE_DOT(c, a, b)            \
    do {                                 \
        if constexpr (Int8)              \
            _tile_dpbusd(c, a, b);       \
        else                             \
            _tile_dpbf16ps(c, a, b);     \
    } while (0)
#else
#define KVT_TILE_DOT(c, a, b)                                          \
    do {                                                               \
        static_assert(!Int8, "int8 tiles need a build with AMX-INT8"); \
        _tile_dpbf16ps(c, a, b);                                       \
    } while (0)
#endif

constexpr int AMX_CHUNK_ROWS = 256;  // rows a pass over the panels takes (chunks_of_panels)
// Tile steps of a panel all of a call's row blocks take in turn before the next ones (a
// block's sums stored and reloaded between: exact), so the steps' weights are read from
// L1 by every block but the first. 2-core AMX Xeon, SmolLM2-135M's projections over 30
// layers' weights (from memory) and the LM head, best of 11 (ms; all steps a block / 8 /
// 12 / 24): 64 rows 17.74 / 17.54 / 16.96 / 17.83; 128 rows 26.93 / 25.35 / 24.90 / 26.93;
// 256 rows 47.97 / 45.14 / 43.86 / 48.02; 16 rows (one block) 11.3 all.
constexpr int AMX_K_STEPS = 12;

// All m rows of ``a`` (``lda`` bytes apart; m <= AMX_CHUNK_ROWS) against one panel of V
// vectors, 16 rows a block, ``steps`` tile steps deep (a step: 64 bytes of a row, 16
// bfloat16 pairs or 16 int8 quads, against 16 such units of the panel's vectors), up to
// AMX_K_STEPS steps of every block at a time; ``finish(r, sums)`` gets row r's V vectors
// of 16 32-bit sums (float32, or int32 with Int8). ``configured``: the block height of
// the tile configuration this thread has loaded (0: none).
template <int V, bool Int8, typename Finish>
void panel_tiles(const uint8_t* a, int64_t lda, int m, const Panel& pn, int steps,
                 const Finish& finish, int& configured) {
    alignas(64) uint32_t sums[AMX_CHUNK_ROWS / 16][V][16 * 16];
    const int64_t b_stride = int64_t(V) * 64;  // bytes from one unit to the next in a vector
    const int blocks = (m + 15) / 16;
    const int chunk = blocks > 1 ? AMX_K_STEPS : steps;
    for (int s0 = 0; s0 < steps; s0 += chunk) {
        const int s1 = s0 + chunk < steps ? s0 + chunk : steps;
        for (int blk = 0; blk < blocks; blk++) {
            const int r0 = blk * 16;
            const int rows = m - r0 < 16 ? m - r0 : 16;
            if (rows != configured) {
                amx_configure(rows);
                configured = rows;
            }
            if (s0 == 0) {
                _tile_zero(0);
                if constexpr (V > 1) _tile_zero(1);
                if constexpr (V > 2) _tile_zero(2);
            } else {
                _tile_loadd(0, sums[blk][0], 64);
                if constexpr (V > 1) _tile_loadd(1, sums[blk][1], 64);
                if constexpr (V > 2) _tile_loadd(2, sums[blk][2], 64);
            }
            const uint8_t* block = a + r0 * lda;
            for (int step = s0; step < s1; step++) {
                const uint32_t* b = pn.data + int64_t(step) * V * 256;
                _tile_loadd(3, block + 64 * step, lda);
                _tile_loadd(4, b, b_stride);
                KVT_TILE_DOT(0, 3, 4);
                if constexpr (V > 1) {
                    _tile_loadd(5, b + 16, b_stride);
                    KVT_TILE_DOT(1, 3, 5);
                }
                if constexpr (V > 2) {
                    _tile_loadd(6, b + 32, b_stride);
                    KVT_TILE_DOT(2, 3, 6);
                }
            }
            _tile_stored(0, sums[blk][0], 64);
            if constexpr (V > 1) _tile_stored(1, sums[blk][1], 64);
            if constexpr (V > 2) _tile_stored(2, sums[blk][2], 64);
            if (s1 < steps) continue;
            for (int r = 0; r < rows; r++) {
                const uint32_t* row[V];
                for (int v = 0; v < V; v++) row[v] = sums[blk][v] + r * 16;
                finish(r0 + r, row);
            }
        }
    }
}

// All m bfloat16 rows of x against one panel (panel_tiles), through the epilogue.
template <int V, typename Epi>
void panel_rows_amx(const uint16_t* x, int64_t ldx, int m, const Panel& pn, int pairs, const Epi& epi,
                    int& configured) {
    panel_tiles<V, false>(reinterpret_cast<const uint8_t*>(x), ldx * 2, m, pn, pairs / 16,
                          [&](int r, const uint32_t* const (&row)[V]) {
                              __m512 y[V];
                              for (int v = 0; v < V; v++) y[v] = _mm512_load_ps(reinterpret_cast<const float*>(row[v]));
                              epi(r, y, pn.col);
                          },
                          configured);
}

// An epilogue for rows from ``shift`` on: row r of a chunk is row shift + r of the call.
template <typename Epi>
struct RowShift {
    const Epi& epi;
    int shift;
    template <int V>
    void operator()(int r, const __m512 (&y)[V], const int64_t* col) const {
        epi(shift + r, y, col);
    }
};

// Inside a parallel region: m rows AMX_CHUNK_ROWS at a time, the threads splitting every
// panel of a chunk (``run(first row, rows, panel, configured)``), so a chunk's rows stay
// in L2 while the panels pass (all of a 2,048-row prefill chunk's rows against every panel
// in turn ran at half oneDNN's speed); the thread's tiles released at the end.
template <typename Run>
void chunks_of_panels(int m, int panels, const Run& run) {
    int configured = 0;
    for (int c0 = 0; c0 < m; c0 += AMX_CHUNK_ROWS) {
        const int rows = m - c0 < AMX_CHUNK_ROWS ? m - c0 : AMX_CHUNK_ROWS;
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) run(c0, rows, p, configured);
    }
    if (configured) _tile_release();
}

template <typename Epi>
void gemm_bf16_amx(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed, int n, int pairs,
                   bool paired, const Epi& epi, int threads) {
    const int vectors = n / 16;
#pragma omp parallel num_threads(threads)
    chunks_of_panels(m, panel_count(vectors, paired), [&](int c0, int rows, int p, int& configured) {
        const Panel pn = panel_of(packed, p, vectors, pairs, paired);
        const uint16_t* xc = x + c0 * ldx;
        const RowShift<Epi> ec{epi, c0};
        switch (pn.vectors) {
            case 1: panel_rows_amx<1>(xc, ldx, rows, pn, pairs, ec, configured); break;
            case 2: panel_rows_amx<2>(xc, ldx, rows, pn, pairs, ec, configured); break;
            default: panel_rows_amx<NR>(xc, ldx, rows, pn, pairs, ec, configured); break;
        }
    });
}

#endif

#ifdef __AVX512VNNI__
// acc + the 4-byte dot products of a (uint8) and w (int8). Inline assembly, not
// _mm512_dpbusd_epi32: GCC 12 keeps the intrinsic's 24 accumulators on the stack (a store
// after every vpdpbusd); with the plain register operand they stay in registers.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i w) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
    return acc;
}

// One vector of int8 sums (inputs offset by +128, so comp = 128 x a column's weight sum
// comes off) scaled by row scale x column scale, for the 16 columns from ``col``.
inline __m512 dequantize(__m512i acc, const int32_t* comp, const float* col_scale, int64_t col,
                         __m512 row_scale) {
    const __m512i c = _mm512_loadu_si512(comp + col);
    const __m512 s = _mm512_loadu_ps(col_scale + col);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, c)), _mm512_mul_ps(s, row_scale));
}

template <int R, int V, typename Epi>
inline void micro_i8(const uint8_t* x, int64_t ldx, const Panel& pn, int quads,
                     const float* row_scale, const float* col_scale, const int32_t* comp, int r0,
                     const Epi& epi) {
    __m512i acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_si512();
    for (int q = 0; q < quads; q++) {
        __m512i w[V];
        for (int v = 0; v < V; v++) w[v] = _mm512_load_si512(pn.data + (int64_t(q) * V + v) * 16);
        for (int r = 0; r < R; r++) {
            uint32_t quad;
            memcpy(&quad, x + r * ldx + 4 * q, sizeof(quad));
            const __m512i a = _mm512_set1_epi32(int(quad));
            for (int v = 0; v < V; v++) acc[r][v] = dpbusd(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 y[V];
        const __m512 rs = _mm512_set1_ps(row_scale[r]);
        for (int v = 0; v < V; v++) y[v] = dequantize(acc[r][v], comp, col_scale, pn.col[v], rs);
        epi(r0 + r, y, pn.col);
    }
}

template <int V, typename Epi>
void panel_rows_i8(const uint8_t* x, int64_t ldx, int m, const Panel& pn, int quads,
                   const float* row_scale, const float* col_scale, const int32_t* comp, const Epi& epi) {
    constexpr int MR = rows_for<V>();
    int r = 0;
    for (; r + MR <= m; r += MR)
        micro_i8<MR, V>(x + r * ldx, ldx, pn, quads, row_scale + r, col_scale, comp, r, epi);
    x += r * ldx;
    row_scale += r;
    switch (m - r) {
#define KVT_R(k) case k: if constexpr (k < MR) micro_i8<k, V>(x, ldx, pn, quads, row_scale, col_scale, comp, r, epi); break;
        KVT_R(1) KVT_R(2) KVT_R(3) KVT_R(4) KVT_R(5) KVT_R(6) KVT_R(7) KVT_R(8) KVT_R(9)
        KVT_R(10) KVT_R(11)
#undef KVT_R
        default: break;
    }
}

// Row x [k] bfloat16 (k % 16 == 0) to uint8 (round(x / scale) + 128, |.| <= 127) and its
// scale max|x| / 127 (0 for a zero row, whose values all become 128).
inline void quantize_row(const uint16_t* x, int k, uint8_t* q, float* scale) {
    auto load = [x](int i) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16));
    };
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(i)));
    const float m = _mm512_reduce_max_ps(amax);
    *scale = m / 127.0f;
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127),
                  offset = _mm512_set1_epi32(128);
    for (int i = 0; i < k; i += 16) {
        __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(load(i), inv));  // round to nearest even
        n = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(n, lo), hi), offset);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(n));
    }
}

#ifdef KVT_AMX_I8
// All m quantized rows against one panel on the tiles (panel_tiles, tdpbusd): exact int32
// sums, then micro_i8's dequantization, so the same outputs bit for bit.
template <int V, typename Epi>
void panel_rows_i8_amx(const uint8_t* x, int64_t ldx, int m, const Panel& pn, int quads,
                       const float* row_scale, const float* col_scale, const int32_t* comp,
                       const Epi& epi, int& configured) {
    panel_tiles<V, true>(x, ldx, m, pn, quads / 16,
                         [&](int r, const uint32_t* const (&row)[V]) {
                             __m512 y[V];
                             const __m512 rs = _mm512_set1_ps(row_scale[r]);
                             for (int v = 0; v < V; v++)
                                 y[v] = dequantize(_mm512_load_si512(row[v]), comp, col_scale, pn.col[v], rs);
                             epi(r, y, pn.col);
                         },
                         configured);
}
#endif

// ``amx``: the panels on the tiles (k a multiple of 64; the caller checks).
template <typename Epi>
void gemm_i8(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed, const float* col_scale,
             const int32_t* comp, int n, int k, bool paired, const Epi& epi, uint8_t* scratch,
             float* row_scale, int threads, bool amx) {
    const int vectors = n / 16, quads = k / 4;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) quantize_row(x + r * ldx, k, scratch + int64_t(r) * k, row_scale + r);
#ifdef KVT_AMX_I8
        if (amx) {
            chunks_of_panels(m, panel_count(vectors, paired), [&](int c0, int rows, int p, int& configured) {
                const Panel pn = panel_of(packed, p, vectors, quads, paired);
                const uint8_t* xc = scratch + int64_t(c0) * k;
                const float* rs = row_scale + c0;
                const RowShift<Epi> ec{epi, c0};
                switch (pn.vectors) {
                    case 1: panel_rows_i8_amx<1>(xc, k, rows, pn, quads, rs, col_scale, comp, ec, configured); break;
                    case 2: panel_rows_i8_amx<2>(xc, k, rows, pn, quads, rs, col_scale, comp, ec, configured); break;
                    default: panel_rows_i8_amx<NR>(xc, k, rows, pn, quads, rs, col_scale, comp, ec, configured); break;
                }
            });
        } else
#else
        (void)amx;
#endif
        {  // the VNNI path
#pragma omp for schedule(static)
            for (int p = 0; p < panel_count(vectors, paired); p++) {
                const Panel pn = panel_of(packed, p, vectors, quads, paired);
                switch (pn.vectors) {
                    case 1: panel_rows_i8<1>(scratch, k, m, pn, quads, row_scale, col_scale, comp, epi); break;
                    case 2: panel_rows_i8<2>(scratch, k, m, pn, quads, row_scale, col_scale, comp, epi); break;
                    default: panel_rows_i8<NR>(scratch, k, m, pn, quads, row_scale, col_scale, comp, epi); break;
                }
            }
        }
    }
}
#endif

}  // namespace

extern "C" {

// Whether this build has the bfloat16 kernel (the compiler targeted AVX512-BF16).
int kvt_gemm_available() {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

// Whether this build has the AMX path and the process may use the tiles (asks the
// kernel for them; 0 where the build or the CPU lacks AMX-BF16 or the kernel refuses).
int kvt_gemm_amx_available() {
#ifdef KVT_AMX
    return kvt_simd::amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// uint32 elements of the packed copy of an [n, k] bfloat16 weight.
int64_t kvt_gemm_packed_size(int n, int k) { return int64_t(n) * (k / 2); }

// W [n, k] bfloat16 (row stride k) into ``packed`` (kvt_gemm_packed_size elements, 64-byte
// aligned), plain or paired (module comment); 1 if n is not a multiple of 16 (32 paired)
// or k is odd, else 0.
int kvt_gemm_pack(const uint16_t* w, int n, int k, int paired, uint32_t* packed) {
    if (!packable(n, k, 2, paired)) return 1;
    pack_layout(n, k / 2, paired, packed, [&](int64_t col, int q) {
        return uint32_t(w[col * k + 2 * q]) | (uint32_t(w[col * k + 2 * q + 1]) << 16);
    });
    return 0;
}

// out (row stride ldo) from x [m, k] (row stride ldx) times the packed weight's
// transpose, on ``threads`` OpenMP threads: [m, n], or with ``silu`` (paired weights
// only) [m, n / 2] = SiLU(gate) * up; ``amx``: on the tiles where k is a multiple of 32
// (after kvt_gemm_amx_available). 1 if the build lacks the kernel or the arguments do not
// fit, else 0.
int kvt_gemm(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed, int n, int k,
             int paired, int silu, uint16_t* out, int64_t ldo, int threads, int amx) {
#ifdef __AVX512BF16__
    if (!packable(n, k, 2, paired) || m < 0 || (silu && !paired)) return 1;
    if (amx && k % 32 == 0) {  // (a k of another size: on the vectors)
#ifdef KVT_AMX
        if (silu)
            gemm_bf16_amx(x, ldx, m, packed, n, k / 2, true, SiluMul{out, ldo}, threads);
        else
            gemm_bf16_amx(x, ldx, m, packed, n, k / 2, paired, Plain{out, ldo}, threads);
        return 0;
#else
        return 1;
#endif
    }
    if (silu)
        gemm_bf16(x, ldx, m, packed, n, k / 2, true, SiluMul{out, ldo}, threads);
    else
        gemm_bf16(x, ldx, m, packed, n, k / 2, paired, Plain{out, ldo}, threads);
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)packed; (void)n; (void)k; (void)paired; (void)silu;
    (void)out; (void)ldo; (void)threads; (void)amx;
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

// W [n, k] int8 (row stride k; n % 16 == 0, 32 paired, k % 16 == 0) into ``packed``
// (n * k / 4 uint32, 64-byte aligned: per quad of inputs 16 columns' 4 weights), plain or
// paired, and ``comp`` [n] = 128 x each column's weight sum; 1 if the shape cannot be
// packed, else 0.
int kvt_gemm_i8_pack(const int8_t* w, int n, int k, int paired, uint32_t* packed, int32_t* comp) {
    if (!packable(n, k, 16, paired)) return 1;
    pack_layout(n, k / 4, paired, packed, [&](int64_t col, int q) {
        uint32_t quad;
        memcpy(&quad, w + col * k + 4 * q, sizeof(quad));
        return quad;
    });
    for (int c = 0; c < n; c++) {
        int32_t sum = 0;
        for (int i = 0; i < k; i++) sum += w[int64_t(c) * k + i];
        comp[c] = 128 * sum;
    }
    return 0;
}

// out (row stride ldo) from x [m, k] bfloat16 (row stride ldx), each row quantized to
// int8 with its own scale (so a row's result does not depend on its batch), times the
// packed int8 weight's transpose, scaled by ``col_scale`` [n]: [m, n], or with ``silu``
// (paired weights only) [m, n / 2] = SiLU(gate) * up. ``scratch`` holds m * k bytes and
// ``row_scale`` m floats. On ``threads`` OpenMP threads; ``amx``: on the tiles where k is
// a multiple of 64 (after kvt_gemm_i8_amx_available; the same outputs). 1 if the build
// lacks the kernel or the arguments do not fit, else 0.
int kvt_gemm_i8(const uint16_t* x, int64_t ldx, int m, const uint32_t* packed,
                const float* col_scale, const int32_t* comp, int n, int k, int paired, int silu,
                uint16_t* out, int64_t ldo, uint8_t* scratch, float* row_scale, int threads,
                int amx) {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    if (!packable(n, k, 16, paired) || m < 0 || (silu && !paired)) return 1;
#ifdef KVT_AMX_I8
    const bool tiles = amx && k % 64 == 0;
#else
    const bool tiles = false;
    (void)amx;
#endif
    if (silu)
        gemm_i8(x, ldx, m, packed, col_scale, comp, n, k, true, SiluMul{out, ldo}, scratch,
                row_scale, threads, tiles);
    else
        gemm_i8(x, ldx, m, packed, col_scale, comp, n, k, paired, Plain{out, ldo}, scratch,
                row_scale, threads, tiles);
    return 0;
#else
    (void)x; (void)ldx; (void)m; (void)packed; (void)col_scale; (void)comp; (void)n; (void)k;
    (void)paired; (void)silu; (void)out; (void)ldo; (void)scratch; (void)row_scale; (void)threads;
    (void)amx;
    return 1;
#endif
}

// Whether this build has the int8 AMX path and the process may use the tiles.
int kvt_gemm_i8_amx_available() {
#ifdef KVT_AMX_I8
    return kvt_simd::amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

}  // extern "C"
