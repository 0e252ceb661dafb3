// Paged attention for x86-64 CPUs with AVX-512, reading K/V from the block pool in place.
//
// Built and loaded by engine/kernels/native_build.py (g++ -O3 -march=native -fopenmp),
// called through ctypes by engine/kernels/cpu_native_attention.py: one call per step and
// layer runs every work item (decode: one row; extend: one KV head over a tile of query
// rows) on the OpenMP threads (see decode_rows). Layout as in engine/attention/base.py:
//
//   q, out     [rows, H, D] float32 or bfloat16 bits (uint16), H = num_kv_heads * G (query
//              heads of a KV head adjacent); token rows any stride apart (Io)
//   k/v_cache  [num_blocks, block_size, num_kv_heads, D] float32 or bfloat16 bits (uint16),
//              or int8 [..., D + 4]: each head's row D int8 values, then its float32
//              scale (x = int8 * scale; written by cpu_fused.cpp's rope_kv_int8)
//   token t of a sequence -> table[t / block_size], offset t % block_size
//
// Both kernels are one pass of online softmax over 16-key tiles (flash attention): a
// tile's 16 dot products of one query are 16 vectors of partial sums, folded into one
// vector of 16 scores by a transposing tree of shuffles and adds (tile_scores) rather
// than 16 horizontal reductions, for several query rows at once so that each key row
// loaded serves them all (decode: the G heads of a KV head; extend: 2-4 rows); exp is
// a degree-7 polynomial with scalef; the arithmetic is float32 (a bfloat16 is the top
// half of a float32, so widening is exact). Two exceptions, asked for per launch
// (``products``): on CPUs with AVX512-BF16, extend and decode over a bfloat16 cache with
// bfloat16 queries run on bfloat16 dot products instead (extend_item_bf16,
// decode_row_bf16); on CPUs with AVX512-VNNI, decode over an int8 cache runs on int16
// integer dot products (decode_row_i8). The engine races each against the float32 path at
// start-up (engine/attention/cpu_probes.py).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <new>
#include <type_traits>

#include "cpu_simd.h"

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Elements of a KV head's row beyond its D values: an int8 row's float32 scale.
template <typename T>
constexpr bool is_int8 = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int row_extra() { return is_int8<T> ? 4 : 0; }

// The dequantization scale of a head's row (1 for float32 and bfloat16 rows).
template <typename T>
inline float row_scale(const T* row, int d) {
    if constexpr (is_int8<T>) {
        float s;
        memcpy(&s, row + d, sizeof(s));
        return s;
    } else {
        return 1.0f;
    }
}

// e^x for x <= 0 (x - running max), within ~2 ulp; x below -87.3 gives ~1e-38, so
// callers zero masked lanes themselves.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2, hi and lo parts
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

constexpr int TILE = 16;  // keys per tile
// The K/V rows of the tile this many tiles ahead are prefetched into L2 as a kernel goes
// (Ahead), a few lines at a time between its own loads: in decode, a key pair's K rows
// while the scores of the current tile's pair run, then the head's V rows before its P.V;
// in prefill, a token's K and V rows per query-row step. Bursts stall the loop on full miss
// buffers. Zen 4 EPYC, 2 threads, bfloat16, SmolLM2's shape, caches from DRAM: decode (64
// rows x 30 layers) 1.18x (bfloat16 products) and 1.22x (float32) over one burst of a
// head's K and V lines before its turn, itself 1.3-1.4x over a burst of the whole tile or
// prefetches into L1; prefill 1.1-1.5x over none (8-64 rows after 1,024 cached tokens).
constexpr int PREFETCH_TILES = 2;

struct Paged {
    int64_t token, block;  // elements between tokens of a block, between blocks
    const int32_t* table;
    int block_size;
    int64_t at(int t) const { return table[t / block_size] * block + (t % block_size) * token; }
    // The offsets of tokens t0 .. t0 + n - 1 (n <= TILE) into ``base``, the rest of the
    // TILE repeating the first (one division per tile, not one per token).
    void tile(int t0, int n, int64_t* base) const {
        int blk = t0 / block_size, off = t0 - blk * block_size;
        int64_t b = int64_t(table[blk]) * block;
        for (int i = 0; i < n; i++) {
            base[i] = b + off * token;
            if (++off == block_size && i + 1 < n) {
                off = 0;
                b = int64_t(table[++blk]) * block;
            }
        }
        for (int i = n; i < TILE; i++) base[i] = base[0];
    }
    // The offsets of the tile PREFETCH_TILES after the one at t0 of a walk over tokens
    // [0, end) into ``next``; how many (0 past the end).
    int ahead(int t0, int end, int64_t* next) const {
        const int t = t0 + TILE * PREFETCH_TILES;
        const int m = t < end ? (end - t < TILE ? end - t : TILE) : 0;
        if (m) tile(t, m, next);
        return m;
    }
};

// 16 float32 values rounded to bfloat16 as torch rounds (to nearest even; NaN -> 0x7FC0).
inline __m256i to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

// The query rows a launch reads and the output rows it writes: float32 or bfloat16 (16-bit
// patterns), [tokens, H, D] with each token's H x D values contiguous and its rows
// ``stride`` elements apart (q may be a view into the step's stacked q/k/v projection), so
// a bfloat16 model's q and out need no float32 copies. Outputs are rounded as torch's
// conversion rounds, so a bfloat16 out holds what the float32 out converted would.
struct Io {
    const void* q;
    int64_t q_stride;
    bool q_bf16;
    void* out;
    int64_t out_stride;
    bool out_bf16;
    // 16 query values of token t from element i of its row, widened to float32
    __m512 load(int64_t t, int64_t i) const {
        const int64_t at = t * q_stride + i;
        return q_bf16 ? load16(static_cast<const uint16_t*>(q) + at)
                      : _mm512_loadu_ps(static_cast<const float*>(q) + at);
    }
    // query values i and i + 1 of token t as one bfloat16 pair (i low); float32 values
    // give their top halves (exact only where they are bfloat16 values: bf16_rows)
    uint32_t pair(int64_t t, int64_t i) const {
        const int64_t at = t * q_stride + i;
        uint32_t w;
        if (q_bf16) {
            memcpy(&w, static_cast<const uint16_t*>(q) + at, sizeof(w));
            return w;
        }
        uint32_t lo, hi;
        memcpy(&lo, static_cast<const float*>(q) + at, sizeof(lo));
        memcpy(&hi, static_cast<const float*>(q) + at + 1, sizeof(hi));
        return (lo >> 16) | (hi & 0xFFFF0000u);
    }
    void store(int64_t t, int64_t i, __m512 x) const {
        const int64_t at = t * out_stride + i;
        if (out_bf16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at), to_bf16(x));
        else
            _mm512_storeu_ps(static_cast<float*>(out) + at, x);
    }
};

// One softmax row's running state: max, sum of exponentials, and C vectors of output.
template <int C>
struct RowState {
    float m = -INFINITY, l = 0.0f;
    __m512 acc[C];
    RowState() {
        for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
    }
    // Fold in a tile's scores ``s`` (lanes outside ``valid`` ignored); the tile's
    // probabilities, unnormalised, go to ``p``.
    void scores(__m512 s, __mmask16 valid, float* p) {
        s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
        float mt = _mm512_reduce_max_ps(s);
        if (mt > m) {
            float alpha = expf(m - mt);
            __m512 a = _mm512_set1_ps(alpha);
            for (int c = 0; c < C; c++) acc[c] = _mm512_mul_ps(acc[c], a);
            l *= alpha;
            m = mt;
        }
        __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
        l += _mm512_reduce_add_ps(e);
        _mm512_storeu_ps(p, e);
    }
    // the normalised output into token t's row from element i
    void store(const Io& io, int64_t t, int64_t i) const {
        __m512 sum = _mm512_set1_ps(l);
        for (int c = 0; c < C; c++) io.store(t, i + 16 * c, _mm512_div_ps(acc[c], sum));
    }
};

// The transposing tree of a tile's scores: ``pair(j, pa, pb)`` gives, for each of R query
// rows, the vectors of partial sums of its products with keys 2j and 2j + 1 (a key's
// score is the sum of its vector's 16 lanes); ``scores`` gets each row's 16 sums as one
// vector (lane i: key i). The tree (pairs of vectors interleaved and added: 32-bit, 64-bit,
// then 128-bit lanes twice) is folded in as the partial sums come, so few stay live.
// ``Int``: the vectors hold int32 sums (their bits in __m512) and are added as integers.
template <int R, bool Int = false, typename Pair>
inline void tile_tree(Pair pair, __m512* scores) {
    auto add = [](__m512 a, __m512 b) {
        if constexpr (Int)
            return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
        else
            return _mm512_add_ps(a, b);
    };
    __m512 x[R][4], held[R];
    for (int j = 0; j < 8; j++) {
        __m512 pa[R], pb[R];
        pair(j, pa, pb);
        for (int r = 0; r < R; r++) {
            __m512 w = add(_mm512_unpacklo_ps(pa[r], pb[r]), _mm512_unpackhi_ps(pa[r], pb[r]));
            if (j & 1) {
                __m512d a = _mm512_castps_pd(held[r]), b = _mm512_castps_pd(w);
                x[r][j >> 1] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
            } else {
                held[r] = w;
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 y0 = add(_mm512_shuffle_f32x4(x[r][0], x[r][1], 0x88),
                        _mm512_shuffle_f32x4(x[r][0], x[r][1], 0xDD));
        __m512 y1 = add(_mm512_shuffle_f32x4(x[r][2], x[r][3], 0x88),
                        _mm512_shuffle_f32x4(x[r][2], x[r][3], 0xDD));
        scores[r] = add(_mm512_shuffle_f32x4(y0, y1, 0x88),
                        _mm512_shuffle_f32x4(y0, y1, 0xDD));
    }
}

// The scores of R query rows (C vectors each, scaled) against a tile of 16 widened keys
// (tile_tree): every key row loaded serves all R query rows.
template <int C, int R, typename Keys>
inline void tile_scores(const __m512* const* q, Keys key, __m512* scores) {
    tile_tree<R>(
        [&](int j, __m512* pa, __m512* pb) {
            __m512 ka[C], kb[C];
            for (int c = 0; c < C; c++) {
                ka[c] = key(2 * j, c);  // vector c of key 2j of the tile, float32
                kb[c] = key(2 * j + 1, c);
            }
            for (int r = 0; r < R; r++) {
                pa[r] = _mm512_mul_ps(q[r][0], ka[0]);
                pb[r] = _mm512_mul_ps(q[r][0], kb[0]);
                for (int c = 1; c < C; c++) {
                    pa[r] = _mm512_fmadd_ps(q[r][c], ka[c], pa[r]);
                    pb[r] = _mm512_fmadd_ps(q[r][c], kb[c], pb[r]);
                }
            }
        },
        scores);
}

// Aligned, initialised running states of ``count`` softmax rows in ``raw``: an alloca of
// row_state_bytes<C>(count) in the caller's own frame.
template <int C>
inline size_t row_state_bytes(int count) {
    return sizeof(RowState<C>) * count + 64;
}
template <int C>
inline RowState<C>* row_states(void* raw, int count) {
    auto* state = reinterpret_cast<RowState<C>*>((reinterpret_cast<uintptr_t>(raw) + 63) & ~uintptr_t(63));
    for (int i = 0; i < count; i++) new (&state[i]) RowState<C>();
    return state;
}

// The K/V rows of one head in the tile PREFETCH_TILES ahead (decode_tiles), for a kernel to
// prefetch into L2 while it works on the current tile: ``count`` token offsets in ``next``.
template <int head_lines>
struct Ahead {
    const int64_t* next;
    int count;
    int64_t head;  // the head's offset in a token's row
    template <typename T>
    void rows(const T* cache, int i0, int i1) const {
        for (int i = i0; i < i1 && i < count; i++)
            for (int l = 0; l < head_lines; l++)
                _mm_prefetch(reinterpret_cast<const char*>(cache + next[i] + head) + 64 * l, _MM_HINT_T1);
    }
};

// Decode's walk over one sequence's ``length`` tokens: tile by tile, every KV head in
// turn (``head(kvh, base, n, ahead)``: the tile's n valid token offsets in base, the rest
// of the TILE repeating the first; ``ahead``: that head's rows PREFETCH_TILES tiles on), so
// each token's K (and V) row is read whole, once. ``HS``: elements of one head's row,
// ``head_lines``: the cache lines it may span.
template <int HS, int head_lines, typename Head>
inline void decode_tiles(const Paged& pg, int length, int num_kv_heads, Head head) {
    for (int t0 = 0; t0 < length; t0 += TILE) {
        const int n = length - t0 < TILE ? length - t0 : TILE;
        int64_t next[TILE];
        const int pm = pg.ahead(t0, length, next);
        int64_t base[TILE];
        pg.tile(t0, n, base);
        for (int kvh = 0; kvh < num_kv_heads; kvh++)
            head(kvh, static_cast<const int64_t*>(base), n,
                 Ahead<head_lines>{next, pm, int64_t(kvh) * HS});
    }
}

// Decode: one query row (all H heads) over its sequence's ``length`` tokens
// (decode_tiles).
template <int D, int G, typename T>
void decode_row(const Io& io, int64_t t, const T* k_cache, const T* v_cache, const int32_t* table,
                int length, int block_size, int num_kv_heads, float scale) {
    constexpr int C = D / 16;
    constexpr int HS = D + row_extra<T>();  // elements of one head's row
    const int64_t token = int64_t(num_kv_heads) * HS;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    // cache lines of one head's K (or V) row (an int8 row of D + 4 bytes may span one more)
    constexpr int head_lines = (HS * int(sizeof(T)) + 63) / 64 + (row_extra<T>() ? 1 : 0);
    RowState<C>* state = row_states<C>(__builtin_alloca(row_state_bytes<C>(num_kv_heads * G)),
                                       num_kv_heads * G);
    const __m512 vscale = _mm512_set1_ps(scale);
    decode_tiles<HS, head_lines>(pg, length, num_kv_heads,
                                 [&](int kvh, const int64_t* base, int n, const Ahead<head_lines>& ahead) {
            const __mmask16 valid = __mmask16((1u << n) - 1);
            __m512 qv[G][C];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++)
                    qv[g][c] = _mm512_mul_ps(io.load(t, (kvh * G + g) * D + 16 * c), vscale);
            const __m512* qg[G];
            for (int g = 0; g < G; g++) qg[g] = qv[g];
            __m512 s[G];
            const T* keys = k_cache + kvh * HS;
            tile_scores<C, G>(
                qg,
                [&](int i, int c) {
                    if (c == 0) ahead.rows(k_cache, i, i + 1);
                    return load16(keys + base[i] + 16 * c);
                },
                s);
            if constexpr (is_int8<T>) {  // q . (scale k) = scale (q . k)
                alignas(64) float ks[TILE];
                for (int i = 0; i < TILE; i++) ks[i] = row_scale(keys + base[i], D);
                const __m512 kscale = _mm512_load_ps(ks);
                for (int g = 0; g < G; g++) s[g] = _mm512_mul_ps(s[g], kscale);
            }
            alignas(64) float p[G][TILE];
            RowState<C>* st = state + kvh * G;
            for (int g = 0; g < G; g++) st[g].scores(s[g], valid, p[g]);
            __m512 acc[G][C];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) acc[g][c] = st[g].acc[c];
            ahead.rows(v_cache, 0, TILE);
            for (int i = 0; i < n; i++) {
                const T* vrow = v_cache + base[i] + kvh * HS;
                const float vs = row_scale(vrow, D);  // p (scale v) = (p scale) v
                __m512 vv[C];
                for (int c = 0; c < C; c++) vv[c] = load16(vrow + 16 * c);
                for (int g = 0; g < G; g++) {
                    __m512 w = _mm512_set1_ps(is_int8<T> ? p[g][i] * vs : p[g][i]);
                    for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) st[g].acc[c] = acc[g][c];
        });
    for (int h = 0; h < num_kv_heads * G; h++) state[h].store(io, t, h * D);
}


// R rows of an extend item against one widened K/V tile: scores, online softmax, P.V.
template <int C, int R>
inline void extend_rows(RowState<C>* state, const __m512* const* q, const int* seen,
                        const float (*keys)[16 * C], const float (*values)[16 * C]) {
    __m512 s[R];
    tile_scores<C, R>(q, [keys](int i, int c) { return _mm512_load_ps(&keys[i][16 * c]); }, s);
    alignas(64) float p[R][TILE];
    int most = 0;
    for (int r = 0; r < R; r++) {
        const int n = seen[r] > 0 ? seen[r] : 0;
        if (n > 0) state[r].scores(s[r], __mmask16((1u << n) - 1), p[r]);
        else for (int i = 0; i < TILE; i++) p[r][i] = 0.0f;  // a row that sees none of the tile
        if (n > most) most = n;
    }
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = state[r].acc[c];
    for (int i = 0; i < most; i++) {
        __m512 vv[C];
        for (int c = 0; c < C; c++) vv[c] = _mm512_load_ps(&values[i][16 * c]);
        for (int r = 0; r < R; r++) {
            __m512 w = _mm512_set1_ps(p[r][i]);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) state[r].acc[c] = acc[r][c];
}

// Store ``heads`` softmax rows whose outputs were summed on unpacked pairs of tokens
// (unpacklo/hi_epi16 of two tokens' rows: decode_row_bf16, decode_row_i8), undoing the
// unpack's order first: in 128-bit lane L, vector 2w holds dims 32w + 8L .. + 3 and
// vector 2w + 1 dims 32w + 8L + 4 .. + 7.
template <int C>
inline void store_unpacked(RowState<C>* state, int heads, const Io& io, int64_t t) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < heads; h++) {
        for (int w = 0; w < C / 2; w++) {
            const __m512 a = state[h].acc[2 * w], b = state[h].acc[2 * w + 1];
            state[h].acc[2 * w] = _mm512_permutex2var_ps(a, first, b);
            state[h].acc[2 * w + 1] = _mm512_permutex2var_ps(a, second, b);
        }
        state[h].store(io, t, h * 16 * C);
    }
}

#ifdef __AVX512BF16__
// Whether query rows [a, b) of KV head ``kvh``'s G heads are bfloat16 values (a bfloat16 q,
// or float32 ones whose low 16 bits are all zero): then their products with bfloat16 keys
// are exact in float32.
inline bool bf16_rows(const Io& io, int a, int b, int kvh, int group, int d) {
    if (io.q_bf16) return true;
    uint32_t low = 0;
    for (int t = a; t < b; t++) {
        const float* row = static_cast<const float*>(io.q) + int64_t(t) * io.q_stride + kvh * group * d;
        for (int i = 0; i < group * d; i++) {
            uint32_t w;
            memcpy(&w, row + i, sizeof(w));
            low |= w;
        }
    }
    return (low & 0xFFFFu) == 0;
}

// Extend over a bfloat16 cache with bfloat16 queries (extend_item's contract) on AVX512-BF16
// dot products (vdpbf16ps: pairs of bfloat16 products, exact, summed into float32):
//   - The item's query rows go 16 to a vector, one row per lane (spare lanes repeat the
//     last row and are never stored).
//   - Q.K: a key's scores against the 16 rows are one chain of D/2 dot products, each
//     taking a pair of the key's values broadcast straight from the cache: no widening
//     and no transposing reduction (extend_rows needs both).
//   - The online softmax runs across lanes: per-row max, sum and rescale are vertical ops.
//   - P.V: V in pairs of keys (interleaved, the instruction's layout) against each row's
//     probabilities rounded to bfloat16 (as torch's bfloat16 flash attention rounds them
//     before its P.V product); the sums, the running max and the normaliser stay float32.
// SmolLM2's shape (9 heads over 3 KV heads, D 64), 2 threads of a Zen 4 EPYC, scattered
// blocks, best of 9, against extend_item's float32 path in the same run (bench/cpu_attention.py):
//   24 rows after 1,024 cached 0.26 vs 0.44 ms; 64 after 1,024 0.57 vs 1.12;
//   512 after 512 3.27 vs 6.55 (277 against 139 GFLOP/s; torch's fused attention 9.03).
// Largest difference from the float32 reference on random normal q/k/v: 3e-4 to 3e-3.
template <int D>
void extend_item_bf16(const Io& io, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int32_t* table, int offset, int a, int b, int kvh, int group,
                      int block_size, int num_kv_heads, float scale) {
    constexpr int C = D / 16, P = D / 2, LANES = 16;
    const int64_t token = int64_t(num_kv_heads) * D;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    const int rows = (b - a) * group;
    const __m512 vscale = _mm512_set1_ps(scale);
    alignas(64) float pt[TILE][LANES];  // a tile's probabilities: key, then row (lane)
    alignas(64) uint32_t qt[P][LANES];  // the rows' value pairs: pair, then row
    alignas(64) float acc[LANES][D];    // the rows' running P.V
    alignas(64) float al[LANES], ls[LANES];
    alignas(64) int32_t pos[LANES];
    for (int g0 = 0; g0 < rows; g0 += LANES) {
        const int nr = rows - g0 < LANES ? rows - g0 : LANES;
        for (int l = 0; l < LANES; l++) {  // spare lanes repeat the last row, never stored
            const int r = g0 + (l < nr ? l : nr - 1);
            const int64_t head = (kvh * group + r % group) * D;
            for (int p = 0; p < P; p++) qt[p][l] = io.pair(a + r / group, head + 2 * p);
            pos[l] = offset + a + r / group;
        }
        memset(acc, 0, sizeof(float) * nr * D);
        const __m512i posv = _mm512_load_si512(pos);
        __m512 m = _mm512_set1_ps(-1e30f), sum = _mm512_setzero_ps();
        const int last = pos[nr - 1];  // rows go in position order
        for (int t0 = 0; t0 <= last; t0 += TILE) {
            const int n = last + 1 - t0 < TILE ? last + 1 - t0 : TILE;
            int64_t base[TILE];
            pg.tile(t0, n, base);
            int64_t next[TILE];
            const Ahead<(D * 2 + 63) / 64> ahead{next, pg.ahead(t0, last + 1, next), int64_t(kvh) * D};
            const uint16_t* krow[TILE];
            for (int i = 0; i < TILE; i++) krow[i] = k_cache + base[i] + kvh * D;
            __m512 s[TILE];
            for (int i = 0; i < TILE; i++) s[i] = _mm512_setzero_ps();
            for (int p = 0; p < P; p++) {
                if (p < TILE) ahead.rows(k_cache, p, p + 1);
                const __m512bh qp = (__m512bh)_mm512_load_si512(qt[p]);
                for (int i = 0; i < TILE; i++) {
                    uint32_t kw;
                    memcpy(&kw, krow[i] + 2 * p, sizeof(kw));
                    s[i] = _mm512_dpbf16_ps(s[i], qp, (__m512bh)_mm512_set1_epi32(int(kw)));
                }
            }
            __mmask16 vis[TILE];
            __m512 mt = m;
            for (int i = 0; i < TILE; i++) {
                vis[i] = i < n ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(t0 + i), posv, _MM_CMPINT_LE) : 0;
                s[i] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis[i], _mm512_mul_ps(s[i], vscale));
                mt = _mm512_max_ps(mt, s[i]);
            }
            const __m512 alpha = exp16(_mm512_sub_ps(m, mt));
            m = mt;
            __m512 tsum = _mm512_setzero_ps();
            for (int i = 0; i < TILE; i++) {
                const __m512 e = _mm512_maskz_mov_ps(vis[i], exp16(_mm512_sub_ps(s[i], m)));
                tsum = _mm512_add_ps(tsum, e);
                _mm512_store_ps(pt[i], e);
            }
            sum = _mm512_fmadd_ps(sum, alpha, tsum);
            _mm512_store_ps(al, alpha);
            // V in key pairs: vector c of pair j holds dims 16c..16c+15 of keys 2j and 2j+1,
            // interleaved (the vdpbf16ps operand); P rounded to bfloat16, in pairs per row.
            alignas(64) uint32_t vp[TILE / 2][C][16];
            alignas(64) uint32_t pp[TILE / 2][LANES];
            const int pairs = (n + 1) / 2;
            ahead.rows(v_cache, 0, TILE);
            for (int j = 0; j < pairs; j++) {
                const uint16_t* va = v_cache + base[2 * j] + kvh * D;
                const uint16_t* vb = 2 * j + 1 < n ? v_cache + base[2 * j + 1] + kvh * D : nullptr;
                for (int c = 0; c < C; c++) {
                    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 16 * c)));
                    const __m512i hi = vb ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 16 * c))), 16)
                                          : _mm512_setzero_si512();
                    _mm512_store_si512(vp[j][c], _mm512_or_si512(lo, hi));
                }
                const __m512i pa = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(pt[2 * j])));
                const __m512i pb = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(pt[2 * j + 1])));
                _mm512_store_si512(pp[j], _mm512_or_si512(pa, _mm512_slli_epi32(pb, 16)));
            }
            constexpr int R = C <= 4 ? 4 : 2;
            for (int r0 = 0; r0 < nr; r0 += R) {
                const int nrr = nr - r0 < R ? nr - r0 : R;
                __m512 o[R][C];
                for (int jr = 0; jr < R; jr++)
                    for (int c = 0; c < C; c++)
                        o[jr][c] = jr < nrr ? _mm512_mul_ps(_mm512_load_ps(&acc[r0 + jr][16 * c]),
                                                            _mm512_set1_ps(al[r0 + jr]))
                                            : _mm512_setzero_ps();
                for (int j = 0; j < pairs; j++) {
                    __m512bh vv[C];
                    for (int c = 0; c < C; c++) vv[c] = (__m512bh)_mm512_load_si512(vp[j][c]);
                    for (int jr = 0; jr < R; jr++) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pp[j][(r0 + jr) & (LANES - 1)]));
                        for (int c = 0; c < C; c++) o[jr][c] = _mm512_dpbf16_ps(o[jr][c], w, vv[c]);
                    }
                }
                for (int jr = 0; jr < nrr; jr++)
                    for (int c = 0; c < C; c++) _mm512_store_ps(&acc[r0 + jr][16 * c], o[jr][c]);
            }
        }
        _mm512_store_ps(ls, sum);
        for (int l = 0; l < nr; l++) {
            const int r = g0 + l;
            const int64_t head = (kvh * group + r % group) * D;
            const __m512 inv = _mm512_set1_ps(ls[l]);
            for (int c = 0; c < C; c++)
                io.store(a + r / group, head + 16 * c, _mm512_div_ps(_mm512_load_ps(&acc[l][16 * c]), inv));
        }
    }
}

// 32 query values of token t from element i of its row as bfloat16 (exact only where they
// are bfloat16 values: bf16_rows).
inline __m512bh load_bf16x32(const Io& io, int64_t t, int64_t i) {
    if (io.q_bf16)
        return (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(io.q) + t * io.q_stride + i);
    return _mm512_cvtne2ps_pbh(io.load(t, i + 16), io.load(t, i));
}

// Decode over a bfloat16 cache with a bfloat16 query row (decode_row's contract) on
// AVX512-BF16 dot products, the AMD counterpart of extend_item_bf16: on Zen 4 a vdpbf16ps
// does twice the multiply-adds of an FMA at the same rate and reads the cache's bfloat16
// values as they are (the float32 path widens every K and V value first):
//   - Q.K: a key's partial sums against each query head are a chain of D/32 dot products
//     of 32-value slices (no widening), then tile_tree as in the float32 path; the scale
//     multiplies the scores (the float32 path scales q).
//   - P.V: V in pairs of tokens, interleaved by unpacklo/hi_epi16 (the instruction's
//     layout) against the pair's probabilities rounded to bfloat16 (as torch's bfloat16
//     flash attention rounds them); the unpack leaves dims in an order the store undoes.
// The running max, the normaliser and the sums stay float32. SmolLM2's shape, 64 rows over
// 24,723 context tokens x 30 layers, 2 threads of a Zen 4 EPYC, against decode_row in the
// same run: from DRAM (bench/cpu_attention.py) 30.3 vs 33.1 ms (1.09x: the loop is mostly
// waiting on memory, 18.8 GB/s of ~35); one layer's caches 30 times (L3-resident) 12.7 vs
// 17.9 ms (1.41x). Largest difference from the float32 path on random normal q/k/v: 2e-3.
template <int D, int G>
void decode_row_bf16(const Io& io, int64_t t, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int32_t* table, int length, int block_size, int num_kv_heads,
                     float scale) {
    constexpr int C = D / 16, W = D / 32;
    static_assert(W >= 1, "decode_row_bf16 needs whole 32-value slices");
    const int64_t token = int64_t(num_kv_heads) * D;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    constexpr int head_lines = (D * 2 + 63) / 64;
    RowState<C>* state = row_states<C>(__builtin_alloca(row_state_bytes<C>(num_kv_heads * G)),
                                       num_kv_heads * G);
    const __m512 vscale = _mm512_set1_ps(scale);
    decode_tiles<D, head_lines>(pg, length, num_kv_heads,
                                [&](int kvh, const int64_t* base, int n, const Ahead<head_lines>& ahead) {
            const __mmask16 valid = __mmask16((1u << n) - 1);
            __m512bh qv[G][W];
            for (int g = 0; g < G; g++)
                for (int w = 0; w < W; w++) qv[g][w] = load_bf16x32(io, t, (kvh * G + g) * D + 32 * w);
            const uint16_t* keys = k_cache + kvh * D;
            __m512 s[G];
            tile_tree<G>(
                [&](int j, __m512* pa, __m512* pb) {
                    ahead.rows(k_cache, 2 * j, 2 * j + 2);
                    __m512bh ka[W], kb[W];
                    for (int w = 0; w < W; w++) {
                        ka[w] = (__m512bh)_mm512_loadu_si512(keys + base[2 * j] + 32 * w);
                        kb[w] = (__m512bh)_mm512_loadu_si512(keys + base[2 * j + 1] + 32 * w);
                    }
                    for (int g = 0; g < G; g++) {
                        pa[g] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], ka[0]);
                        pb[g] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kb[0]);
                        for (int w = 1; w < W; w++) {
                            pa[g] = _mm512_dpbf16_ps(pa[g], qv[g][w], ka[w]);
                            pb[g] = _mm512_dpbf16_ps(pb[g], qv[g][w], kb[w]);
                        }
                    }
                },
                s);
            alignas(64) float p[G][TILE];
            alignas(64) uint32_t pp[G][TILE / 2];  // the probabilities as bfloat16 pairs
            RowState<C>* st = state + kvh * G;
            for (int g = 0; g < G; g++) {
                st[g].scores(_mm512_mul_ps(s[g], vscale), valid, p[g]);
                _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]),
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[g])));
            }
            __m512 acc[G][C];  // vector 2w: the low halves of slice w's unpacked pairs, 2w + 1: the high
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) acc[g][c] = st[g].acc[c];
            ahead.rows(v_cache, 0, TILE);
            for (int j = 0; 2 * j < n; j++) {
                const uint16_t* va = v_cache + base[2 * j] + kvh * D;
                const uint16_t* vb = v_cache + base[2 * j + 1] + kvh * D;
                const bool odd = 2 * j + 1 == n;  // the tile's last token has no partner
                __m512bh lo[W], hi[W];
                for (int w = 0; w < W; w++) {
                    const __m512i a = _mm512_loadu_si512(va + 32 * w);
                    const __m512i b = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(vb + 32 * w);
                    lo[w] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                    hi[w] = (__m512bh)_mm512_unpackhi_epi16(a, b);
                }
                for (int g = 0; g < G; g++) {
                    const __m512bh pw = (__m512bh)_mm512_set1_epi32(int(pp[g][j]));
                    for (int w = 0; w < W; w++) {
                        acc[g][2 * w] = _mm512_dpbf16_ps(acc[g][2 * w], pw, lo[w]);
                        acc[g][2 * w + 1] = _mm512_dpbf16_ps(acc[g][2 * w + 1], pw, hi[w]);
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) st[g].acc[c] = acc[g][c];
        });
    store_unpacked<C>(state, num_kv_heads * G, io, t);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Decode over an int8 cache (decode_row's contract) on AVX512-VNNI integer dot products
// (vpdpwssd: pairs of int16 products summed exactly into int32), where the float32 path
// widens every K and V value to float32 (two instructions per 16 values) and multiplies
// in float32:
//   - the query's heads are quantized to int16 once per row, per head (scale = max |q| /
//     32767: an error of at most 1.5e-5 of the largest value, far below the bfloat16
//     rounding the model's q already carries); Q.K of a key is a chain of
//     D/32 vpdpwssd over the key's int8 values sign-extended to int16 (one instruction
//     per 32), reduced by tile_tree in int32 (exact: |sum| <= 128 x 127 x 32767 < 2^31),
//     then widened and multiplied by q's scale, the key row's scale and the softmax
//     scale;
//   - P.V: per tile and head, w = p x (the V row's scale) quantized to int16 against the
//     tile's largest w (error at most 1.5e-5 of it; the bfloat16 path rounds P to 2^-9),
//     V in pairs of tokens interleaved by unpacklo/hi_epi16 (decode_row_bf16's layout),
//     summed exactly in int32 over the tile, then added to the float32 output times
//     that scale.
// The running max, normaliser and outputs stay float32; outputs within ~1e-4 of the float32
// path's. SmolLM2's shape, 64 rows over 24,723 context tokens x 30 layers, 2 threads of a
// Zen 4 EPYC, against decode_row in the same run: from DRAM 16.9 vs 19.9 ms (1.17x,
// bench/cpu_attention.py), one layer's caches 30 times (L3-resident) 1.21x; in the engine's
// 64-request run (int8 linears and KV) decode attention 2.43-2.63 vs 2.64-2.79 s. Still
// compute-bound (the float32 path's tree and softmax remain): 19 GB/s of the ~30 that
// scattered 6 KiB K/V blocks stream at here.
template <int D, int G>
void decode_row_i8(const Io& io, int64_t t, const int8_t* k_cache, const int8_t* v_cache,
                   const int32_t* table, int length, int block_size, int num_kv_heads,
                   float scale) {
    constexpr int C = D / 16, W = D / 32;
    static_assert(W >= 1, "decode_row_i8 needs whole 32-value slices");
    constexpr int HS = D + row_extra<int8_t>();
    const int64_t token = int64_t(num_kv_heads) * HS;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    constexpr int head_lines = (HS + 63) / 64 + 1;
    RowState<C>* state = row_states<C>(__builtin_alloca(row_state_bytes<C>(num_kv_heads * G)),
                                       num_kv_heads * G);
    // The query's heads as int16 (vector w of head h: dims 32w .. 32w + 31), each with its
    // scale times the softmax scale.
    const int heads = num_kv_heads * G;
    auto* qbuf = reinterpret_cast<__m512i*>(
        (reinterpret_cast<uintptr_t>(__builtin_alloca(sizeof(__m512i) * heads * W + 64)) + 63) & ~uintptr_t(63));
    float* qscales = static_cast<float*>(__builtin_alloca(sizeof(float) * heads));
    for (int h = 0; h < heads; h++) {
        __m512 x[C];
        __m512 amax = _mm512_setzero_ps();
        for (int c = 0; c < C; c++) {
            x[c] = io.load(t, h * D + 16 * c);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(x[c]));
        }
        const float a = _mm512_reduce_max_ps(amax);
        const __m512 inv = _mm512_set1_ps(a > 0.0f ? 32767.0f / a : 0.0f);
        qscales[h] = a / 32767.0f * scale;
        for (int w = 0; w < W; w++) {
            const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[2 * w], inv)));
            const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[2 * w + 1], inv)));
            qbuf[h * W + w] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
    }
    decode_tiles<HS, head_lines>(pg, length, num_kv_heads,
                                 [&](int kvh, const int64_t* base, int n, const Ahead<head_lines>& ahead) {
            const __mmask16 valid = __mmask16((1u << n) - 1);
            const __m512i* qv = qbuf + kvh * G * W;  // head g's slice w: qv[g * W + w]
            const float* qscale = qscales + kvh * G;
            const int8_t* keys = k_cache + kvh * HS;
            __m512 s[G];
            tile_tree<G, true>(
                [&](int j, __m512* pa, __m512* pb) {
                    ahead.rows(k_cache, 2 * j, 2 * j + 2);
                    __m512i ka[W], kb[W];
                    for (int w = 0; w < W; w++) {
                        ka[w] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + base[2 * j] + 32 * w)));
                        kb[w] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + base[2 * j + 1] + 32 * w)));
                    }
                    for (int g = 0; g < G; g++) {
                        __m512i ia = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qv[g * W], ka[0]);
                        __m512i ib = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qv[g * W], kb[0]);
                        for (int w = 1; w < W; w++) {
                            ia = _mm512_dpwssd_epi32(ia, qv[g * W + w], ka[w]);
                            ib = _mm512_dpwssd_epi32(ib, qv[g * W + w], kb[w]);
                        }
                        pa[g] = _mm512_castsi512_ps(ia);
                        pb[g] = _mm512_castsi512_ps(ib);
                    }
                },
                s);
            alignas(64) float ks[TILE], vs[TILE];
            for (int i = 0; i < TILE; i++) {
                ks[i] = row_scale(keys + base[i], D);
                vs[i] = row_scale(v_cache + base[i] + kvh * HS, D);
            }
            const __m512 kscale = _mm512_load_ps(ks), vscale = _mm512_load_ps(vs);
            alignas(64) float p[G][TILE];
            alignas(64) uint32_t pw[G][TILE / 2];  // p x V's scale as int16 pairs
            float wscale[G];
            RowState<C>* st = state + kvh * G;
            for (int g = 0; g < G; g++) {
                st[g].scores(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(s[g])),
                                           _mm512_mul_ps(kscale, _mm512_set1_ps(qscale[g]))), valid, p[g]);
                const __m512 w = _mm512_mul_ps(_mm512_load_ps(p[g]), vscale);  // >= 0; 0 outside valid
                const float wmax = _mm512_reduce_max_ps(w);
                wscale[g] = wmax / 32767.0f;
                const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f);
                _mm256_store_si256(reinterpret_cast<__m256i*>(pw[g]),
                                   _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w, inv))));
            }
            __m512i iacc[G][C];  // vector 2w: the low halves of slice w's unpacked pairs, 2w + 1: the high
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) iacc[g][c] = _mm512_setzero_si512();
            ahead.rows(v_cache, 0, TILE);
            for (int j = 0; 2 * j < n; j++) {
                const int8_t* va = v_cache + base[2 * j] + kvh * HS;
                const int8_t* vb = v_cache + base[2 * j + 1] + kvh * HS;
                const bool odd = 2 * j + 1 == n;  // the tile's last token has no partner
                __m512i lo[W], hi[W];
                for (int w = 0; w < W; w++) {
                    const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 32 * w)));
                    const __m512i b = odd ? _mm512_setzero_si512()
                                          : _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 32 * w)));
                    lo[w] = _mm512_unpacklo_epi16(a, b);
                    hi[w] = _mm512_unpackhi_epi16(a, b);
                }
                for (int g = 0; g < G; g++) {
                    const __m512i pair = _mm512_set1_epi32(int(pw[g][j]));
                    for (int w = 0; w < W; w++) {
                        iacc[g][2 * w] = _mm512_dpwssd_epi32(iacc[g][2 * w], pair, lo[w]);
                        iacc[g][2 * w + 1] = _mm512_dpwssd_epi32(iacc[g][2 * w + 1], pair, hi[w]);
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                const __m512 ws = _mm512_set1_ps(wscale[g]);
                for (int c = 0; c < C; c++)
                    st[g].acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g][c]), ws, st[g].acc[c]);
            }
        });
    store_unpacked<C>(state, num_kv_heads * G, io, t);
}
#endif

// Extend: query rows [a, b) of one sequence's chunk, for the G heads of KV head ``kvh``;
// row i sits at position offset + i and sees keys 0 .. offset + i (causal after the
// cached prefix). Each K/V tile is widened once into a float32 buffer and serves every
// row of the item; a row stops at its last visible tile; the tile PREFETCH_TILES ahead is
// prefetched a token per group of rows. With ``products``, bfloat16
// caches and queries go to extend_item_bf16 where this build has it.
template <int D, typename T>
void extend_item(const Io& io, const T* k_cache, const T* v_cache, const int32_t* table,
                 int offset, int a, int b, int kvh, int group, int block_size,
                 int num_kv_heads, float scale, bool products) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, uint16_t>) {
        if (products && bf16_rows(io, a, b, kvh, group, D)) {
            extend_item_bf16<D>(io, k_cache, v_cache, table, offset, a, b, kvh, group,
                                block_size, num_kv_heads, scale);
            return;
        }
    }
#else
    (void)products;
#endif
    constexpr int C = D / 16;
    constexpr int HS = D + row_extra<T>();  // elements of one head's row
    const int64_t token = int64_t(num_kv_heads) * HS;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    const int rows = (b - a) * group;
    RowState<C>* state = row_states<C>(__builtin_alloca(row_state_bytes<C>(rows)), rows);
    __m512* qs = static_cast<__m512*>(__builtin_alloca(sizeof(__m512) * rows * C + 64));
    qs = reinterpret_cast<__m512*>((reinterpret_cast<uintptr_t>(qs) + 63) & ~uintptr_t(63));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        const int64_t head = (kvh * group + r % group) * D;
        for (int c = 0; c < C; c++) qs[r * C + c] = _mm512_mul_ps(io.load(a + r / group, head + 16 * c), vscale);
    }
    constexpr int ROWS = C <= 4 ? 4 : 2;  // as many as registers allow (4: ~10% over 2)
    alignas(64) float kbuf[TILE][D], vbuf[TILE][D];
    const int end = offset + b;  // keys visible to the last row
    constexpr int head_lines = (HS * int(sizeof(T)) + 63) / 64 + (row_extra<T>() ? 1 : 0);
    for (int t0 = 0; t0 < end; t0 += TILE) {
        const int n = end - t0 < TILE ? end - t0 : TILE;
        int64_t next[TILE];
        const Ahead<head_lines> ahead{next, pg.ahead(t0, end, next), int64_t(kvh) * HS};
        for (int i = 0; i < TILE; i++) {
            if (i < n) {
                const int64_t at = pg.at(t0 + i) + kvh * HS;
                if constexpr (is_int8<T>) {  // dequantized as widened
                    const __m512 ks = _mm512_set1_ps(row_scale(k_cache + at, D));
                    const __m512 vs = _mm512_set1_ps(row_scale(v_cache + at, D));
                    for (int c = 0; c < C; c++) {
                        _mm512_store_ps(&kbuf[i][16 * c], _mm512_mul_ps(load16(k_cache + at + 16 * c), ks));
                        _mm512_store_ps(&vbuf[i][16 * c], _mm512_mul_ps(load16(v_cache + at + 16 * c), vs));
                    }
                } else {
                    for (int c = 0; c < C; c++) {
                        _mm512_store_ps(&kbuf[i][16 * c], load16(k_cache + at + 16 * c));
                        _mm512_store_ps(&vbuf[i][16 * c], load16(v_cache + at + 16 * c));
                    }
                }
            } else {
                memset(kbuf[i], 0, sizeof(kbuf[i]));
            }
        }
        int r = 0;  // rows in groups: each K/V row loaded serves ROWS query rows
        int fetched = 0;  // tokens of the tile ahead prefetched, one a group of rows
        for (; r + ROWS <= rows; r += ROWS) {
            if (fetched < TILE) {
                ahead.rows(k_cache, fetched, fetched + 1);
                ahead.rows(v_cache, fetched, fetched + 1);
                fetched++;
            }
            int seen[ROWS], any = 0;
            const __m512* qr[ROWS];
            for (int j = 0; j < ROWS; j++) {
                seen[j] = offset + a + (r + j) / group + 1 - t0;
                if (seen[j] > n) seen[j] = n;
                any |= seen[j] > 0;
                qr[j] = qs + (r + j) * C;
            }
            if (!any) continue;
            extend_rows<C, ROWS>(state + r, qr, seen, kbuf, vbuf);
        }
        ahead.rows(k_cache, fetched, TILE);
        ahead.rows(v_cache, fetched, TILE);
        for (; r < rows; r++) {
            int seen = offset + a + r / group + 1 - t0;
            if (seen > n) seen = n;
            if (seen > 0) {
                const __m512* qr[1] = {qs + r * C};
                extend_rows<C, 1>(state + r, qr, &seen, kbuf, vbuf);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        state[r].store(io, a + r / group, (kvh * group + r % group) * D);
}

// run(std::integral_constant<int, group>{}) for a group size of 1..8: 0, else 1.
template <typename Run>
int by_group(int group, Run&& run) {
    switch (group) {
#define KVT_G(g) case g: run(std::integral_constant<int, g>{}); return 0;
        KVT_G(1) KVT_G(2) KVT_G(3) KVT_G(4) KVT_G(5) KVT_G(6) KVT_G(7) KVT_G(8)
#undef KVT_G
    }
    return 1;
}

template <typename T, int D>
int decode_d(int group, const Io& io, int64_t t, const T* k, const T* v, const int32_t* table,
             int length, int block_size, int num_kv_heads, float scale, bool products) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, uint16_t> && D % 32 == 0) {
        if (products && bf16_rows(io, int(t), int(t) + 1, 0, num_kv_heads * group, D))
            return by_group(group, [&](auto g) {
                decode_row_bf16<D, g()>(io, t, k, v, table, length, block_size, num_kv_heads, scale);
            });
    }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, int8_t> && D % 32 == 0) {
        if (products)
            return by_group(group, [&](auto g) {
                decode_row_i8<D, g()>(io, t, k, v, table, length, block_size, num_kv_heads, scale);
            });
    }
#endif
    (void)products;
    return by_group(group, [&](auto g) {
        decode_row<D, g(), T>(io, t, k, v, table, length, block_size, num_kv_heads, scale);
    });
}

template <typename T>
int decode_any(int head_dim, int group, const Io& io, int64_t t, const T* k, const T* v,
               const int32_t* table, int length, int block_size, int num_kv_heads, float scale,
               bool products) {
    switch (head_dim) {
        case 16: return decode_d<T, 16>(group, io, t, k, v, table, length, block_size, num_kv_heads, scale, products);
        case 32: return decode_d<T, 32>(group, io, t, k, v, table, length, block_size, num_kv_heads, scale, products);
        case 64: return decode_d<T, 64>(group, io, t, k, v, table, length, block_size, num_kv_heads, scale, products);
        case 128: return decode_d<T, 128>(group, io, t, k, v, table, length, block_size, num_kv_heads, scale, products);
    }
    return 1;
}

template <typename T>
int extend_any(int head_dim, int group, const Io& io, const T* k, const T* v, const int32_t* table,
               int offset, int a, int b, int kvh, int block_size, int num_kv_heads, float scale,
               bool products) {
    switch (head_dim) {
#define KVT_D(d) case d: extend_item<d, T>(io, k, v, table, offset, a, b, kvh, group, block_size, num_kv_heads, scale, products); return 0;
        KVT_D(16) KVT_D(32) KVT_D(64) KVT_D(128)
#undef KVT_D
    }
    return 1;
}

// The launchers: every decode row, or every (query tile, KV head) item of a prefill
// chunk, handed out one at a time (rows' contexts differ up to 64x in length; a chunk's
// last tiles, which see the most keys, first) to the threads of the OpenMP runtime the
// process already runs. Built with -fopenmp, this library needs libgomp.so.1, which is
// torch's own copy once torch is loaded (the loader matches the name), so the
// attention and torch's ops share one pool of threads: no second runtime (numba's
// launchers loaded the system's libgomp) whose idle workers spin on the same cores.
// In-process, 64 requests, AMX Xeon, 3 interleaved pairs: 1.01-1.04x the numba launch.
template <typename T>
int decode_rows(int head_dim, int group, const Io& io, const T* k, const T* v,
                const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                const int64_t* q_rows, const int64_t* seq_ids, int rows, int block_size,
                int num_kv_heads, float scale, int threads, int products) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : bad)
    for (int r = 0; r < rows; r++) {
        const int64_t s = seq_ids[r];
        bad += decode_any<T>(head_dim, group, io, q_rows[r], k, v, tables + s * table_stride,
                             seq_lens[s], block_size, num_kv_heads, scale, products != 0);
    }
    return bad;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVT_ATTN_AMX 1
// Prefill over a bfloat16 (or int8) cache on the AMX tiles (extend_amx): per KV head, the
// chunk's context is packed once into the tiles' operand layouts (int8 rows dequantized to
// bfloat16 on the way), then each work item (16 query tokens of one query head) runs two
// exact passes instead of an online softmax:
//   1. S = Q K^T, a 16 x 16 tile of scores per 16 keys (A: the 16 query rows, 32 dims a
//      tile; B: the keys' dims in pairs, packed as [pair][key]), written to a row buffer;
//      then per row the scaled, causally masked scores' max, the probabilities
//      exp(s - max) rounded to bfloat16 (as torch's bfloat16 flash attention and
//      extend_item_bf16 round them) and their float32 sum;
//   2. O = P V, 32 keys a tile step (A: the probabilities; B: V in key pairs, packed as
//      [pair][dim]) summed in D / 16 float32 C tiles over the whole context, then O / sum.
// Products exact, sums float32 as in the other bfloat16 paths (the order differs).
// head_dim 32 or 64 (two passes' tiles fit the eight); other shapes keep the AVX-512 path.
// Why: on a 2-core AMX Xeon, SmolLM2's shape (9 heads over 3 KV heads, D 64), bfloat16,
// scattered blocks, best of 9 (us; this path / the AVX-512 path / torch's fused attention
// over the gathered context): 272 queries 191 / 572 / 370; 512 after 512 cached 1,303 /
// 5,168 / 2,102; 24 after 1,024 184 / 438 / 340; 2,048 6,161 / 27,829 / 9,001 (784 GFLOP/s).
// int8 cache: 272 queries 181 vs 501 us, 512 after 512 1,175 vs 4,553. The engine's
// 64-request prefill (16,103 prompt tokens) spent 1.29 s in attention on torch's path,
// 0.55 s here.
// A head's K or V row of token ``key`` as D bfloat16 values: a bfloat16 cache's in place,
// an int8 cache's dequantized (int8 x its row's scale, rounded to bfloat16) into ``tmp``.
template <int D, typename T>
inline const uint16_t* bf16_row(const T* cache, int64_t at, uint16_t* tmp) {
    if constexpr (is_int8<T>) {
        const __m512 scale = _mm512_set1_ps(row_scale(cache + at, D));
        for (int c = 0; c < D / 16; c++)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load16(cache + at + 16 * c), scale)));
        return tmp;
    } else {
        (void)tmp;
        return cache + at;
    }
}

// Keys kb * 16 .. kb * 16 + 15 of one KV head's context in the tiles' layouts: ``kt``
// [keys / 16][D / 32][16 pairs][16 keys] and ``vv`` [keys / 2][D], both uint32 pairs of
// bfloat16 values; keys from ``length`` on zero.
template <int D, typename T>
void amx_pack_block(const T* k_cache, const T* v_cache, const Paged& pg, int64_t head, int length,
                    int kb, uint32_t* kt, uint32_t* vv) {
    constexpr int H = D / 32;
    alignas(64) uint16_t tmp[2][D];
    uint32_t* ktb = kt + int64_t(kb) * H * 256;
    for (int n = 0; n < 16; n++) {
        const int key = kb * 16 + n;
        uint32_t row[D / 2] = {};
        if (key < length) memcpy(row, bf16_row<D>(k_cache, pg.at(key) + head, tmp[0]), sizeof(row));
        for (int h = 0; h < H; h++)
            for (int p = 0; p < 16; p++) ktb[(h * 16 + p) * 16 + n] = row[h * 16 + p];
    }
    for (int j = kb * 8; j < kb * 8 + 8; j++) {
        const int k0 = 2 * j, k1 = 2 * j + 1;
        const uint16_t* a = k0 < length ? bf16_row<D>(v_cache, pg.at(k0) + head, tmp[0]) : nullptr;
        const uint16_t* b = k1 < length ? bf16_row<D>(v_cache, pg.at(k1) + head, tmp[1]) : nullptr;
        uint32_t* out = vv + int64_t(j) * D;
        for (int d = 0; d < D; d++)
            out[d] = (a ? uint32_t(a[d]) : 0u) | ((b ? uint32_t(b[d]) : 0u) << 16);
    }
}

// One work item: query tokens [a, a + 16) (fewer at the end) of query head ``head`` (of
// KV head ``kvh``), over its packed context. ``s`` and ``pb``: scratch of 16 x ``cap``
// floats and bfloat16 values.
template <int D>
void amx_item(const Io& io, const uint32_t* kt, const uint32_t* vv, int offset, int q_len, int a,
              int head, float scale, float* s, uint16_t* pb) {
    constexpr int H = D / 32, O = D / 16;
    const int nr = q_len - a < 16 ? q_len - a : 16;
    const int visible = offset + a + nr;              // keys the item's last row sees
    const int width = (visible + 31) / 32 * 32;       // row length of s and pb
    alignas(64) uint16_t qs[16][D];
    for (int r = 0; r < 16; r++) {
        const int t = a + (r < nr ? r : nr - 1);  // spare rows repeat the last, never stored
        for (int h = 0; h < H; h++)
            _mm512_store_si512(&qs[r][32 * h], (__m512i)load_bf16x32(io, t, int64_t(head) * D + 32 * h));
    }
    // pass 1: scores, 16 keys a tile
    _tile_loadd(1, &qs[0][0], D * 2);
    if constexpr (H > 1) _tile_loadd(2, &qs[0][32], D * 2);
    for (int kb = 0; kb < width / 16; kb++) {
        const uint32_t* b = kt + int64_t(kb) * H * 256;
        _tile_zero(0);
        _tile_loadd(3, b, 64);
        _tile_dpbf16ps(0, 1, 3);
        if constexpr (H > 1) {
            _tile_loadd(4, b + 256, 64);
            _tile_dpbf16ps(0, 2, 4);
        }
        _tile_stored(0, s + kb * 16, width * 4);
    }
    alignas(64) float sums[16];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < 16; r++) {
        float* row = s + int64_t(r) * width;
        uint16_t* prow = pb + int64_t(r) * width;
        const int seen = offset + a + (r < nr ? r : nr - 1) + 1;  // keys 0 .. seen - 1
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < width; j += 16) {
            const int left = seen - j;
            const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : 0;
            mx = _mm512_max_ps(mx, _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), m, _mm512_loadu_ps(row + j), vscale));
        }
        const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < width; j += 16) {
            const int left = seen - j;
            const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : 0;
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(row + j), vscale), vmax)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sums[r] = _mm512_reduce_add_ps(sum);
    }
    // pass 2: P V, 32 keys a tile step, the D dims in O tiles of 16
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (O > 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int j = 0; j < width / 32; j++) {
        _tile_loadd(4, pb + 32 * j, width * 2);
        const uint32_t* b = vv + int64_t(16 * j) * D;
        _tile_loadd(5, b, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (O > 2) {
            _tile_loadd(7, b + 32, D * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 48, D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    alignas(64) float o[O][16 * 16];
    _tile_stored(0, o[0], 64);
    _tile_stored(1, o[1], 64);
    if constexpr (O > 2) {
        _tile_stored(2, o[2], 64);
        _tile_stored(3, o[3], 64);
    }
    for (int r = 0; r < nr; r++) {
        const __m512 inv = _mm512_set1_ps(sums[r]);
        for (int c = 0; c < O; c++)
            io.store(a + r, int64_t(head) * D + 16 * c, _mm512_div_ps(_mm512_load_ps(o[c] + r * 16), inv));
    }
}

// Every query row of a chunk (extend_items' contract) on the tiles, over a bfloat16 or an
// int8 cache (its rows dequantized to bfloat16 as they are packed); 1 if head_dim is not
// one extend_amx runs.
template <typename T>
int extend_amx(int head_dim, int group, const Io& io, int q_len, const T* k, const T* v,
               const int32_t* table, int offset, int block_size, int num_kv_heads, float scale,
               int threads) {
    if (head_dim != 32 && head_dim != 64) return 1;
    const int length = offset + q_len;
    const int padded = (length + 31) / 32 * 32;
    const int64_t per_head = int64_t(padded) * head_dim / 2;  // uint32 pairs of one head's K (or V)
    uint32_t* kt = static_cast<uint32_t*>(::operator new(sizeof(uint32_t) * per_head * num_kv_heads * 2, std::align_val_t(64)));
    uint32_t* vv = kt + per_head * num_kv_heads;
    const int64_t hs = head_dim + row_extra<T>();  // elements of one head's row
    const int64_t token = int64_t(num_kv_heads) * hs;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    const int key_blocks = padded / 16, tiles = (q_len + 15) / 16;
    const int items = tiles * num_kv_heads * group;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < num_kv_heads * key_blocks; i++) {
            const int kvh = i / key_blocks, kb = i % key_blocks;
            if (head_dim == 64)
                amx_pack_block<64>(k, v, pg, kvh * hs, length, kb, kt + kvh * per_head, vv + kvh * per_head);
            else
                amx_pack_block<32>(k, v, pg, kvh * hs, length, kb, kt + kvh * per_head, vv + kvh * per_head);
        }
        float* s = static_cast<float*>(::operator new(sizeof(float) * 16 * padded, std::align_val_t(64)));
        uint16_t* pb = static_cast<uint16_t*>(::operator new(sizeof(uint16_t) * 16 * padded, std::align_val_t(64)));
        kvt_simd::configure_tiles(16, 8);  // every tile 16 rows
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            const int a = (tiles - 1 - item / (num_kv_heads * group)) * 16;  // the longest first
            const int head = item % (num_kv_heads * group), kvh = head / group;
            if (head_dim == 64)
                amx_item<64>(io, kt + kvh * per_head, vv + kvh * per_head, offset, q_len, a, head, scale, s, pb);
            else
                amx_item<32>(io, kt + kvh * per_head, vv + kvh * per_head, offset, q_len, a, head, scale, s, pb);
        }
        _tile_release();
        ::operator delete(s, std::align_val_t(64));
        ::operator delete(pb, std::align_val_t(64));
    }
    ::operator delete(kt, std::align_val_t(64));
    return 0;
}

#endif

template <typename T>
int extend_items(int head_dim, int group, const Io& io, int q_len, const T* k, const T* v,
                 const int32_t* table, int offset, int block_size, int num_kv_heads,
                 float scale, int tile, int threads, int products) {
#ifdef KVT_ATTN_AMX
    if constexpr (std::is_same_v<T, uint16_t> || is_int8<T>) {
        if (products == 2 && (head_dim == 32 || head_dim == 64) &&
            bf16_rows(io, 0, q_len, 0, num_kv_heads * group, head_dim))  // (else the vectors')
            return extend_amx(head_dim, group, io, q_len, k, v, table, offset, block_size,
                              num_kv_heads, scale, threads);
    }
#endif
    const int tiles = (q_len + tile - 1) / tile;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : bad)
    for (int item = 0; item < tiles * num_kv_heads; item++) {
        const int a = (tiles - 1 - item / num_kv_heads) * tile;
        const int b = a + tile < q_len ? a + tile : q_len;
        bad += extend_any<T>(head_dim, group, io, k, v, table, offset, a, b,
                             item % num_kv_heads, block_size, num_kv_heads, scale,
                             products != 0);
    }
    return bad;
}

}  // namespace

// The entry points (ctypes): the launchers above, by cache dtype; q and out each a pointer,
// its token rows' stride in elements and whether it holds bfloat16 (else float32). Each
// returns 0, or the number of items whose head_dim / group it was not built for (the
// caller checks those first: 16, 32, 64, 128 and 1..8).
extern "C" {

#define KVT_LAUNCHERS(suffix, T)                                                              \
    int kvt_decode_rows_##suffix(int head_dim, int group, const void* q, int64_t q_stride,      \
                                 int q_bf16, const T* k, const T* v, const int32_t* tables,     \
                                 int64_t table_stride, const int32_t* seq_lens,                 \
                                 const int64_t* q_rows, const int64_t* seq_ids, int rows,       \
                                 int block_size, int num_kv_heads, float scale, void* out,      \
                                 int64_t out_stride, int out_bf16, int threads, int products) { \
        const Io io{q, q_stride, q_bf16 != 0, out, out_stride, out_bf16 != 0};                  \
        return decode_rows<T>(head_dim, group, io, k, v, tables, table_stride, seq_lens,        \
                              q_rows, seq_ids, rows, block_size, num_kv_heads, scale, threads,  \
                              products);                                                        \
    }                                                                                           \
    int kvt_extend_items_##suffix(int head_dim, int group, const void* q, int64_t q_stride,     \
                                  int q_bf16, int q_len, const T* k, const T* v,                \
                                  const int32_t* table, int offset, int block_size,             \
                                  int num_kv_heads, float scale, void* out, int64_t out_stride, \
                                  int out_bf16, int tile, int threads, int products) {          \
        const Io io{q, q_stride, q_bf16 != 0, out, out_stride, out_bf16 != 0};                  \
        return extend_items<T>(head_dim, group, io, q_len, k, v, table, offset, block_size,     \
                               num_kv_heads, scale, tile, threads, products);                   \
    }
KVT_LAUNCHERS(f32, float)
KVT_LAUNCHERS(bf16, uint16_t)
KVT_LAUNCHERS(int8, int8_t)
#undef KVT_LAUNCHERS

// Whether this build has extend_amx and the process may use the AMX tiles (asks the
// kernel for them once granted: 0 where the build or the CPU lacks AMX-BF16 or the kernel
// refuses).
int kvt_extend_amx() {
#ifdef KVT_ATTN_AMX
    return kvt_simd::amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// Whether this build has decode_row_i8 (the compiler targeted AVX512-VNNI).
int kvt_int8_products() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

// Whether this build has extend_item_bf16 (the compiler targeted AVX512-BF16).
int kvt_bf16_products() {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
