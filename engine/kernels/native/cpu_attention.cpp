// Paged attention for x86-64 CPUs with AVX-512, reading K/V from the block pool in place.
//
// Built and loaded by engine/kernels/native_build.py (g++ -O3 -march=native -fopenmp),
// called through ctypes by engine/kernels/cpu_native_attention.py: one call per step and
// layer runs every work item (decode: one row; extend: one KV head over a tile of query
// rows) on the OpenMP threads (see decode_rows). Layout as in engine/attention/base.py:
//
//   q, out     [rows, H, D] float32, H = num_kv_heads * G (query heads of a KV head adjacent)
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
// half of a float32, so widening is exact).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <new>
#include <type_traits>

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
// Decode: the K/V rows of the tile this many tiles ahead are prefetched into L2, a KV
// head's slice at a time, between that head's tiles (spread out, not in one burst: a
// burst of the whole tile's lines, or prefetches into L1, stalled the loop on full miss
// buffers). On a Zen 4 EPYC (2 threads, bfloat16, 64 rows x 30 layers from DRAM) that
// made decode 1.3-1.4x faster than a burst into L1 (bench/cpu_attention.py).
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
    void store(float* out) const {
        __m512 sum = _mm512_set1_ps(l);
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(acc[c], sum));
    }
};

// The scores of R query rows (C vectors each, scaled) against a tile of 16 widened keys,
// each row's 16 as one vector (lane i: key i). The tree (pairs of vectors interleaved
// and added: 32-bit, 64-bit, then 128-bit lanes twice) is folded in as the partial sums
// come, so few stay live, and every key row loaded serves all R query rows.
template <int C, int R, typename Keys>
inline void tile_scores(const __m512* const* q, Keys key, __m512* scores) {
    __m512 x[R][4], held[R];
    for (int j = 0; j < 8; j++) {
        __m512 ka[C], kb[C];
        for (int c = 0; c < C; c++) {
            ka[c] = key(2 * j, c);  // vector c of key 2j of the tile, float32
            kb[c] = key(2 * j + 1, c);
        }
        for (int r = 0; r < R; r++) {
            __m512 pa = _mm512_mul_ps(q[r][0], ka[0]), pb = _mm512_mul_ps(q[r][0], kb[0]);
            for (int c = 1; c < C; c++) {
                pa = _mm512_fmadd_ps(q[r][c], ka[c], pa);
                pb = _mm512_fmadd_ps(q[r][c], kb[c], pb);
            }
            __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(pa, pb), _mm512_unpackhi_ps(pa, pb));
            if (j & 1) {
                __m512d a = _mm512_castps_pd(held[r]), b = _mm512_castps_pd(w);
                x[r][j >> 1] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
            } else {
                held[r] = w;
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[r][0], x[r][1], 0x88),
                                  _mm512_shuffle_f32x4(x[r][0], x[r][1], 0xDD));
        __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[r][2], x[r][3], 0x88),
                                  _mm512_shuffle_f32x4(x[r][2], x[r][3], 0xDD));
        scores[r] = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88),
                                  _mm512_shuffle_f32x4(y0, y1, 0xDD));
    }
}

// Decode: one query row (all H heads) over its sequence's ``length`` tokens. Per tile,
// every KV head in turn, so each token's K (and V) row is read whole, once.
template <int D, int G, typename T>
void decode_row(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                int length, int block_size, int num_kv_heads, float scale, float* out) {
    constexpr int C = D / 16;
    constexpr int HS = D + row_extra<T>();  // elements of one head's row
    const int64_t token = int64_t(num_kv_heads) * HS;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    // cache lines of one head's K (or V) row (an int8 row of D + 4 bytes may span one more)
    constexpr int head_lines = (HS * int(sizeof(T)) + 63) / 64 + (row_extra<T>() ? 1 : 0);
    RowState<C>* state = static_cast<RowState<C>*>(
        __builtin_alloca(sizeof(RowState<C>) * num_kv_heads * G + 64));
    state = reinterpret_cast<RowState<C>*>((reinterpret_cast<uintptr_t>(state) + 63) & ~uintptr_t(63));
    for (int i = 0; i < num_kv_heads * G; i++) new (&state[i]) RowState<C>();
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < length; t0 += TILE) {
        const int n = length - t0 < TILE ? length - t0 : TILE;
        const __mmask16 valid = __mmask16((1u << n) - 1);
        const int ahead = t0 + TILE * PREFETCH_TILES;
        const int pm = ahead < length ? (length - ahead < TILE ? length - ahead : TILE) : 0;
        int64_t next[TILE];
        if (pm) pg.tile(ahead, pm, next);
        int64_t base[TILE];
        pg.tile(t0, n, base);
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            __m512 qv[G][C];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++)
                    qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (kvh * G + g) * D + 16 * c), vscale);
            const __m512* qg[G];
            for (int g = 0; g < G; g++) qg[g] = qv[g];
            __m512 s[G];
            for (int i = 0; i < pm; i++)  // the next tiles' rows of this head, into L2
                for (int l = 0; l < head_lines; l++) {
                    _mm_prefetch(reinterpret_cast<const char*>(k_cache + next[i] + kvh * HS) + 64 * l, _MM_HINT_T1);
                    _mm_prefetch(reinterpret_cast<const char*>(v_cache + next[i] + kvh * HS) + 64 * l, _MM_HINT_T1);
                }
            const T* keys = k_cache + kvh * HS;
            tile_scores<C, G>(
                qg, [keys, &base](int i, int c) { return load16(keys + base[i] + 16 * c); }, s);
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
        }
    }
    for (int h = 0; h < num_kv_heads * G; h++) state[h].store(out + h * D);
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

// Extend: query rows [a, b) of one sequence's chunk, for the G heads of KV head ``kvh``;
// row i sits at position offset + i and sees keys 0 .. offset + i (causal after the
// cached prefix). Each K/V tile is widened once into a float32 buffer and serves every
// row of the item; a row stops at its last visible tile.
template <int D, typename T>
void extend_item(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                 int offset, int a, int b, int kvh, int group, int block_size,
                 int num_kv_heads, float scale, float* out) {
    constexpr int C = D / 16;
    const int heads = num_kv_heads * group;
    constexpr int HS = D + row_extra<T>();  // elements of one head's row
    const int64_t token = int64_t(num_kv_heads) * HS;
    const Paged pg{token, int64_t(block_size) * token, table, block_size};
    const int rows = (b - a) * group;
    RowState<C>* state = static_cast<RowState<C>*>(__builtin_alloca(sizeof(RowState<C>) * rows + 64));
    state = reinterpret_cast<RowState<C>*>((reinterpret_cast<uintptr_t>(state) + 63) & ~uintptr_t(63));
    for (int r = 0; r < rows; r++) new (&state[r]) RowState<C>();
    __m512* qs = static_cast<__m512*>(__builtin_alloca(sizeof(__m512) * rows * C + 64));
    qs = reinterpret_cast<__m512*>((reinterpret_cast<uintptr_t>(qs) + 63) & ~uintptr_t(63));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        const float* qr = q + (int64_t(a + r / group) * heads + kvh * group + r % group) * D;
        for (int c = 0; c < C; c++) qs[r * C + c] = _mm512_mul_ps(_mm512_loadu_ps(qr + 16 * c), vscale);
    }
    constexpr int ROWS = C <= 4 ? 4 : 2;  // as many as registers allow (4: ~10% over 2)
    alignas(64) float kbuf[TILE][D], vbuf[TILE][D];
    const int end = offset + b;  // keys visible to the last row
    for (int t0 = 0; t0 < end; t0 += TILE) {
        const int n = end - t0 < TILE ? end - t0 : TILE;
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
        for (; r + ROWS <= rows; r += ROWS) {
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
        state[r].store(out + (int64_t(a + r / group) * heads + kvh * group + r % group) * D);
}

template <typename T, int D>
int decode_d(int group, const float* q, const T* k, const T* v, const int32_t* table, int length,
             int block_size, int num_kv_heads, float scale, float* out) {
    switch (group) {
#define KVT_G(g) case g: decode_row<D, g, T>(q, k, v, table, length, block_size, num_kv_heads, scale, out); return 0;
        KVT_G(1) KVT_G(2) KVT_G(3) KVT_G(4) KVT_G(5) KVT_G(6) KVT_G(7) KVT_G(8)
#undef KVT_G
    }
    return 1;
}

template <typename T>
int decode_any(int head_dim, int group, const float* q, const T* k, const T* v, const int32_t* table,
               int length, int block_size, int num_kv_heads, float scale, float* out) {
    switch (head_dim) {
        case 16: return decode_d<T, 16>(group, q, k, v, table, length, block_size, num_kv_heads, scale, out);
        case 32: return decode_d<T, 32>(group, q, k, v, table, length, block_size, num_kv_heads, scale, out);
        case 64: return decode_d<T, 64>(group, q, k, v, table, length, block_size, num_kv_heads, scale, out);
        case 128: return decode_d<T, 128>(group, q, k, v, table, length, block_size, num_kv_heads, scale, out);
    }
    return 1;
}

template <typename T>
int extend_any(int head_dim, int group, const float* q, const T* k, const T* v, const int32_t* table,
               int offset, int a, int b, int kvh, int block_size, int num_kv_heads, float scale,
               float* out) {
    switch (head_dim) {
#define KVT_D(d) case d: extend_item<d, T>(q, k, v, table, offset, a, b, kvh, group, block_size, num_kv_heads, scale, out); return 0;
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
int decode_rows(int head_dim, int group, const float* q, const T* k, const T* v,
                const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                const int64_t* q_rows, const int64_t* seq_ids, int rows, int block_size,
                int num_kv_heads, float scale, float* out, int threads) {
    const int64_t row = int64_t(num_kv_heads) * group * head_dim;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : bad)
    for (int r = 0; r < rows; r++) {
        const int64_t qi = q_rows[r], s = seq_ids[r];
        bad += decode_any<T>(head_dim, group, q + qi * row, k, v, tables + s * table_stride,
                             seq_lens[s], block_size, num_kv_heads, scale, out + qi * row);
    }
    return bad;
}

template <typename T>
int extend_items(int head_dim, int group, const float* q, int q_len, const T* k, const T* v,
                 const int32_t* table, int offset, int block_size, int num_kv_heads,
                 float scale, float* out, int tile, int threads) {
    const int tiles = (q_len + tile - 1) / tile;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : bad)
    for (int item = 0; item < tiles * num_kv_heads; item++) {
        const int a = (tiles - 1 - item / num_kv_heads) * tile;
        const int b = a + tile < q_len ? a + tile : q_len;
        bad += extend_any<T>(head_dim, group, q, k, v, table, offset, a, b,
                             item % num_kv_heads, block_size, num_kv_heads, scale, out);
    }
    return bad;
}

}  // namespace

// The entry points (ctypes): the launchers above, by cache dtype. Each returns 0, or the
// number of items whose head_dim / group it was not built for (the caller checks those
// first: 16, 32, 64, 128 and 1..8).
extern "C" {

#define KVT_LAUNCHERS(suffix, T)                                                              \
    int kvt_decode_rows_##suffix(int head_dim, int group, const float* q, const T* k,           \
                                 const T* v, const int32_t* tables, int64_t table_stride,       \
                                 const int32_t* seq_lens, const int64_t* q_rows,                \
                                 const int64_t* seq_ids, int rows, int block_size,              \
                                 int num_kv_heads, float scale, float* out, int threads) {      \
        return decode_rows<T>(head_dim, group, q, k, v, tables, table_stride, seq_lens, q_rows, \
                              seq_ids, rows, block_size, num_kv_heads, scale, out, threads);    \
    }                                                                                           \
    int kvt_extend_items_##suffix(int head_dim, int group, const float* q, int q_len,           \
                                  const T* k, const T* v, const int32_t* table, int offset,     \
                                  int block_size, int num_kv_heads, float scale, float* out,    \
                                  int tile, int threads) {                                      \
        return extend_items<T>(head_dim, group, q, q_len, k, v, table, offset, block_size,      \
                               num_kv_heads, scale, out, tile, threads);                        \
    }
KVT_LAUNCHERS(f32, float)
KVT_LAUNCHERS(bf16, uint16_t)
KVT_LAUNCHERS(int8, int8_t)
#undef KVT_LAUNCHERS

}  // extern "C"
