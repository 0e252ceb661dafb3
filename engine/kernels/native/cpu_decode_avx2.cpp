// Paged decode attention for x86-64 CPUs with AVX2 and FMA but no AVX-512, where the
// AVX-512 kernels (cpu_attention.cpp) do not build and decode rows ran through numba's
// three stages (scores, torch softmax, weighted sum) at ~48 GFLOP/s on a 2-core EPYC:
// compute-bound, a bfloat16 cache no faster than a float32 one. Called through ctypes from
// engine/kernels/cpu_decode_avx2.py; built by engine/kernels/native_build.py with
// -fopenmp (the library's libgomp.so.1 resolves to the copy torch has loaded).
//
//   q, out     [num_q, H, D] float32; decode row r is q[q_rows[r]], of sequence seq_ids[r]
//   k/v cache  [num_blocks, block_size, Hkv, D] float32, or bfloat16 as uint16 bits
//   token t of sequence s -> block tables[s * table_stride + t / block_size], t % block_size
//
// One work item per decode row, spread over the OpenMP threads (handed out one at a
// time: contexts differ in length). A row reads each token's K rows once, in order, all
// KV heads together (a bfloat16 row widened exactly: bits << 16), for all its query heads
// (q scaled once), the scores kept in a per-thread buffer; then an exact softmax per head
// (max, exp, sum, probabilities as torch.softmax gives them) and each token's V rows read
// once, added into H x D float32 sums. A row's arithmetic runs in one fixed order whatever
// the thread count or the other rows: its output does not depend on its batch. exp is a
// Cephes-style float32 exp (range reduction by ln 2, degree-5 polynomial) within ~2 ulp
// of expf: results are float32-close to the reference, not bit-equal.
//
// SmolLM2-135M's shape (9 heads over 3 KV heads, head_dim 64), 64 rows of 350 tokens, one
// layer, 2 threads, AVX2 EPYC: float32 cache 1.81 ms (numba 2.14-2.96), bfloat16 1.53 ms
// (numba 2.22-2.67); one thread 3.0-3.9 / 2.5-3.1 ms. A float32 cache streams ~17 GB/s.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <vector>

#include "cpu_avx2.h"

namespace {

constexpr int MAX_GROUP = 8;
// The head sizes built (dispatch's cases and kvt_avx2_head_dim_ok's answer).
#define KVT_HEAD_DIMS(X) X(8) X(16) X(32) X(64) X(96) X(128) X(256)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// For each KV head of one token's rows (all KV heads, D apart): its row as V vectors,
// then f(h, row) for each of the group's query heads h.
template <int V, typename T, typename F>
inline void each_head(const T* rows, int hkv, int group, F f) {
    for (int kh = 0; kh < hkv; kh++) {
        __m256 row[V];
        for (int i = 0; i < V; i++) row[i] = load8(rows + kh * V * 8 + 8 * i);
        for (int g = 0; g < group; g++) f(kh * group + g, row);
    }
}

// One decode row, all its heads: q row [H, D] (heads of KV head h at h * group ..), out
// likewise; the sequence's block table and length. ``scores``: [H, length] scratch,
// ``acc``: [H, D] scratch.
template <typename T, int D>
void row(int group, int hkv, const float* q, const T* k, const T* v, const int32_t* table,
         int length, int block_size, float scale, float* out, std::vector<float>& scores,
         std::vector<float>& acc) {
    constexpr int V = D / 8;
    const int heads = group * hkv;
    scores.resize(size_t(heads) * length);
    acc.assign(size_t(heads) * D * 2, 0.0f);  // the sums, then q * scale
    float* s = scores.data();
    float* a = acc.data();
    float* qs = a + heads * D;
    for (int j = 0; j < heads * D; j += 8)
        _mm256_storeu_ps(qs + j, _mm256_mul_ps(load8(q + j), _mm256_set1_ps(scale)));
    const int64_t token_stride = int64_t(hkv) * D;  // a token's K (or V) rows, all KV heads
    const int64_t block_stride = int64_t(block_size) * token_stride;
    auto token = [&](const T* cache, int t) {  // token t's rows, all KV heads
        return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    };
    // scores: each token's K rows read once, in order, for every head
    for (int t = 0; t < length; t++) {
        each_head<V>(token(k, t), hkv, group, [&](int h, const __m256* kv) {
            const float* qh = qs + h * D;
            __m256 sum = _mm256_mul_ps(load8(qh), kv[0]);
            for (int i = 1; i < V; i++) sum = _mm256_fmadd_ps(load8(qh + 8 * i), kv[i], sum);
            s[h * length + t] = hsum(sum);
        });
    }
    // exact softmax per head: probabilities e^(s - max) / sum, as torch.softmax gives
    for (int h = 0; h < heads; h++) {
        float* r = s + h * length;
        float mx = -INFINITY;
        for (int t = 0; t < length; t++) mx = r[t] > mx ? r[t] : mx;
        const __m256 m = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int t = 0;
        for (; t + 8 <= length; t += 8) {
            __m256 e = kvt_avx2::exp8(_mm256_sub_ps(load8(r + t), m));
            _mm256_storeu_ps(r + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        if (t < length) {
            alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int j = t; j < length; j++) tail[j - t] = r[j] - mx;
            alignas(32) float te[8];
            _mm256_store_ps(te, kvt_avx2::exp8(_mm256_load_ps(tail)));
            for (int j = t; j < length; j++) {
                r[j] = te[j - t];
                sum += te[j - t];
            }
        }
        const float f = 1.0f / sum;
        for (int j = 0; j < length; j++) r[j] *= f;
    }
    // weighted sum: each token's V rows read once, in order, added into every head's sums
    for (int t = 0; t < length; t++) {
        each_head<V>(token(v, t), hkv, group, [&](int h, const __m256* vv) {
            const __m256 p = _mm256_set1_ps(s[h * length + t]);
            float* ah = a + h * D;
            for (int i = 0; i < V; i++)
                _mm256_storeu_ps(ah + 8 * i, _mm256_fmadd_ps(p, vv[i], load8(ah + 8 * i)));
        });
    }
    for (int h = 0; h < heads; h++) memcpy(out + h * D, a + h * D, sizeof(float) * D);
}

template <typename T, int D>
int rows(int group, const float* q, int64_t q_stride, const T* k, const T* v,
         const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
         const int64_t* q_rows, const int64_t* seq_ids, int n_rows, int block_size, int hkv,
         float scale, float* out, int threads) {
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores, acc;
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < n_rows; r++) {
            const int64_t seq = seq_ids[r];
            row<T, D>(group, hkv, q + q_rows[r] * q_stride, k, v, tables + seq * table_stride,
                      seq_lens[seq], block_size, scale, out + q_rows[r] * q_stride, scores, acc);
        }
    }
    return 0;
}

template <typename T>
int dispatch(int head_dim, int group, const float* q, int64_t q_stride, const T* k, const T* v,
             const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
             const int64_t* q_rows, const int64_t* seq_ids, int n_rows, int block_size, int hkv,
             float scale, float* out, int threads) {
    if (group < 1 || group > MAX_GROUP || threads < 1) return 1;
#define KVT_D(d)                                                                              \
    case d:                                                                                   \
        return rows<T, d>(group, q, q_stride, k, v, tables, table_stride, seq_lens, q_rows,   \
                          seq_ids, n_rows, block_size, hkv, scale, out, threads);
    switch (head_dim) {
        KVT_HEAD_DIMS(KVT_D)
        default:
            return 1;
    }
#undef KVT_D
}

}  // namespace

extern "C" {

// The head sizes built: a caller checks with this before relying on the kernel.
int kvt_avx2_head_dim_ok(int head_dim) {
#define KVT_OK(d) case d:
    switch (head_dim) {
        KVT_HEAD_DIMS(KVT_OK)
        return 1;
        default:
            return 0;
    }
#undef KVT_OK
}

int kvt_avx2_max_group() { return MAX_GROUP; }

// Nonzero: refused (a head_dim or group not built, no threads); nothing written then.
int kvt_avx2_decode_rows(int head_dim, int group, const float* q, int64_t q_stride,
                         const void* k, const void* v, int cache_bf16, const int32_t* tables,
                         int64_t table_stride, const int32_t* seq_lens, const int64_t* q_rows,
                         const int64_t* seq_ids, int n_rows, int block_size, int hkv,
                         float scale, float* out, int threads) {
    if (cache_bf16)
        return dispatch<uint16_t>(head_dim, group, q, q_stride, static_cast<const uint16_t*>(k),
                                  static_cast<const uint16_t*>(v), tables, table_stride, seq_lens,
                                  q_rows, seq_ids, n_rows, block_size, hkv, scale, out, threads);
    return dispatch<float>(head_dim, group, q, q_stride, static_cast<const float*>(k),
                           static_cast<const float*>(v), tables, table_stride, seq_lens, q_rows,
                           seq_ids, n_rows, block_size, hkv, scale, out, threads);
}
}
