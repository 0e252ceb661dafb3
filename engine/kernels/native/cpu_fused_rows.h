// The fused RoPE + K/V write kernels' row loops, shared by the AVX-512 and AVX2 builds
// (cpu_fused.cpp, cpu_fused_avx2.cpp). Included inside each one's anonymous namespace,
// after its own rotate_head, copy_head, quantize_head and widen_head (the vector code);
// what is here does not depend on the vector width.
#pragma once

// Rows of qkv ([q heads | k heads | v heads] of head_dim each): each row's q heads
// rotated in place, then write_kv(its k heads (its v heads follow), cos, sin, slot)
// puts its K and V into the caches (rope_kv, rope_kv_int8).
template <typename T, typename WriteKV>
void rope_rows(T* qkv, int64_t row_stride, int rows, int num_heads, int head_dim,
               const int64_t* positions, const T* cos_table, const T* sin_table,
               const int64_t* slots, WriteKV write_kv) {
    for (int r = 0; r < rows; r++) {
        T* row = qkv + r * row_stride;
        const T* cos = cos_table + positions[r] * head_dim;
        const T* sin = sin_table + positions[r] * head_dim;
        for (int h = 0; h < num_heads; h++)
            rotate_head(row + h * head_dim, cos, sin, head_dim, row + h * head_dim);
        write_kv(row + int64_t(num_heads) * head_dim, cos, sin, slots[r]);
    }
}

// Float caches: k rotated into k_cache at the row's slot, v copied into v_cache there.
template <typename T>
void rope_kv(T* qkv, int64_t row_stride, int rows, int num_heads, int num_kv_heads,
             int head_dim, const int64_t* positions, const T* cos_table, const T* sin_table,
             const int64_t* slots, T* k_cache, T* v_cache) {
    const int64_t slot_elems = int64_t(num_kv_heads) * head_dim;
    rope_rows(qkv, row_stride, rows, num_heads, head_dim, positions, cos_table, sin_table, slots,
              [&](const T* k_src, const T* cos, const T* sin, int64_t slot) {
                  T* k_dst = k_cache + slot * slot_elems;
                  for (int h = 0; h < num_kv_heads; h++)
                      rotate_head(k_src + h * head_dim, cos, sin, head_dim, k_dst + h * head_dim);
                  copy_head(k_src + slot_elems, int(slot_elems), v_cache + slot * slot_elems);
              });
}

// An int8 KV cache row of one head: d int8 values, then the float32 scale (x = q * scale)
// in the next 4 bytes. Symmetric per (token, head): scale = max|x| / 127 and
// q = round-half-even(x * (127 / max|x|)); the torch reference,
// engine.kernels.kv_int8.quantize_rows, computes the same float32 operations.
constexpr int INT8_SCALE_BYTES = 4;
constexpr int MAX_HEAD_DIM = 256;

// rope_kv for int8 caches: q rotated in place; k rotated (rounded to T, as the model's
// own K) and v, quantized per head into the caches' rows of head_dim + 4 bytes.
template <typename T>
void rope_kv_int8(T* qkv, int64_t row_stride, int rows, int num_heads, int num_kv_heads,
                  int head_dim, const int64_t* positions, const T* cos_table, const T* sin_table,
                  const int64_t* slots, int8_t* k_cache, int8_t* v_cache) {
    const int64_t head_row = head_dim + INT8_SCALE_BYTES;
    const int64_t slot_bytes = int64_t(num_kv_heads) * head_row;
    alignas(64) T rotated[MAX_HEAD_DIM];
    alignas(64) float wide[MAX_HEAD_DIM];
    rope_rows(qkv, row_stride, rows, num_heads, head_dim, positions, cos_table, sin_table, slots,
              [&](const T* k_src, const T* cos, const T* sin, int64_t slot) {
                  int8_t* k_dst = k_cache + slot * slot_bytes;
                  int8_t* v_dst = v_cache + slot * slot_bytes;
                  const T* v_src = k_src + int64_t(num_kv_heads) * head_dim;
                  for (int h = 0; h < num_kv_heads; h++) {
                      rotate_head(k_src + h * head_dim, cos, sin, head_dim, rotated);
                      widen_head(rotated, head_dim, wide);
                      quantize_head(wide, head_dim, k_dst + h * head_row);
                      widen_head(v_src + h * head_dim, head_dim, wide);
                      quantize_head(wide, head_dim, v_dst + h * head_row);
                  }
              });
}
