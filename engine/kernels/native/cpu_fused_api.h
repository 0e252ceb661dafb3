// The fused small ops' entry points (engine.kernels.cpu_fused), shared by the AVX-512
// build (cpu_fused.cpp) and the AVX2 one (cpu_fused_avx2.cpp): included at the end of
// each, after its kernels (add_rmsnorm, rope_kv, rope_kv_int8, silu_mul, argmax_rows and
// MAX_HEAD_DIM, in an anonymous namespace), so both export the same functions.
#pragma once

#include <omp.h>
#include <stdint.h>

namespace {

// ``run(first, count)`` over rows [0, rows): one run each for up to ``threads`` OpenMP
// threads (rows are independent, so any split gives the same values).
template <typename Run>
inline void over_rows(int rows, int threads, Run run) {
    if (threads <= 1 || rows < 2) {
        run(0, rows);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int n = omp_get_num_threads(), t = omp_get_thread_num();
        const int a = int(int64_t(rows) * t / n), b = int(int64_t(rows) * (t + 1) / n);
        if (b > a) run(a, b - a);
    }
}

}  // namespace

extern "C" {

// Each entry point: 0, or 1 where it refuses its arguments; ``threads``: OpenMP threads to
// split the rows over (over_rows). x may be null (no residual add: the first layer's
// input norm).
#define KVT_NORM(suffix, T)                                                                  \
    int kvt_add_rmsnorm_##suffix(const T* x, int64_t xs, T* res, int64_t rs, const T* w,   \
                                 T* out, int64_t os, int rows, int width, float eps,        \
                                 int threads) {                                             \
        if (width < 8) return 1;                                                            \
        over_rows(rows, threads, [&](int a, int n) {                                        \
            add_rmsnorm(x ? x + a * xs : x, xs, res + a * rs, rs, w, out + a * os, os, n,   \
                        width, eps);                                                        \
        });                                                                                 \
        return 0;                                                                           \
    }
KVT_NORM(f32, float)
KVT_NORM(bf16, uint16_t)
#undef KVT_NORM

#define KVT_ROPE(name, suffix, T, C, max_d)                                                  \
    int kvt_##name##_##suffix(T* qkv, int64_t stride, int rows, int heads, int kv_heads,    \
                              int d, const int64_t* pos, const T* cos, const T* sin,        \
                              const int64_t* slots, C* k_cache, C* v_cache, int threads) {  \
        if (d % 2 != 0 || d > max_d) return 1;                                              \
        over_rows(rows, threads, [&](int a, int n) {                                        \
            name(qkv + a * stride, stride, n, heads, kv_heads, d, pos + a, cos, sin,        \
                 slots + a, k_cache, v_cache);                                              \
        });                                                                                 \
        return 0;                                                                           \
    }
KVT_ROPE(rope_kv, f32, float, float, 1 << 30)
KVT_ROPE(rope_kv, bf16, uint16_t, uint16_t, 1 << 30)
KVT_ROPE(rope_kv_int8, f32, float, int8_t, MAX_HEAD_DIM)
KVT_ROPE(rope_kv_int8, bf16, uint16_t, int8_t, MAX_HEAD_DIM)
#undef KVT_ROPE

#define KVT_SILU(suffix, T)                                                                  \
    int kvt_silu_mul_##suffix(const T* gu, int64_t is, T* out, int64_t os, int rows,        \
                              int width, int threads) {                                     \
        over_rows(rows, threads, [&](int a, int n) {                                        \
            silu_mul(gu + a * is, is, out + a * os, os, n, width);                          \
        });                                                                                 \
        return 0;                                                                           \
    }
KVT_SILU(f32, float)
KVT_SILU(bf16, uint16_t)
#undef KVT_SILU

// float32 rows only (the LM head's logits); ``out``: int64 indices.
int kvt_argmax_rows(const float* x, int64_t stride, int rows, int width, int64_t* out,
                    int threads) {
    if (width < 1) return 1;
    over_rows(rows, threads, [&](int a, int n) { argmax_rows(x + a * stride, stride, n, width, out + a); });
    return 0;
}

}  // extern "C"
