// One decoder layer of a bf16 decode step on CPU in one call: the chain model.DecoderLayer
// runs op by op (RMSNorm, QKV GEMM, RoPE + KV store, paged attention, O GEMM, RMSNorm,
// gate_up GEMM, SiLU-and-mul, down GEMM), through the same C functions in the same order,
// so the result is the op-by-op path's bit for bit. What it removes is the ~10 Python and
// ctypes calls a layer costs between them (~5 us each): at batch 1 the GEMMs read the
// weights in ~9 ms and those calls added ~5 ms.
//
// The caller (engine.kernels.decode_layers_cpu) checks every shape and pointer once per
// step; the GEMM weights are the AMX packings (gemm_amx.c), the cache bf16.

#include "cpu_native.h"

#define BF16 2

// What one layer reads: its weights (bf16) and its cache. Built once per model.
typedef struct {
    const void *input_norm, *post_attention_norm;  // [H]
    const void *qkv, *o, *gate_up, *down;          // amx_pack_weight's layout
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias;  // [out], or NULL
    void *k_cache, *v_cache;                       // [N, block_size, Hkv, D]
} DecodeLayer;

// What every layer of one step shares: the batch and its buffers. Built once per step.
typedef struct {
    int64_t tokens, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
    int64_t block_size, table_width;
    float eps, softmax_scale;
    const void *cos, *sin;        // [T, D] (engine.rope tables)
    const int64_t *slots;         // [T]
    const int32_t *block_tables;  // [T, table_width]
    const int32_t *context_lens;  // [T]
    void *hidden, *residual;      // [T, H]: in and out
    // scratch, contiguous: [T, H], [T, (Hq + 2 Hkv) D], [T, Hq, D], [T, Hkv, D],
    // [T, Hq D], [T, 2 I], [T, I]
    void *normed, *qkv, *q, *k, *attention, *gate_up, *activated;
    int threads;
} DecodeStep;

// hidden, residual <- the layer over (hidden, residual); `first`: there is no residual yet
// (it becomes hidden). Returns 0, -1 where the AMX GEMM refused (no AMX here), -2 where
// attention could not allocate its scratch.
int decode_layer_bf16(const DecodeLayer *layer, const DecodeStep *s, int first) {
    const int64_t T = s->tokens, H = s->hidden_size, Hq = s->num_heads, Hkv = s->num_kv_heads;
    const int64_t D = s->head_dim, I = s->intermediate_size;
    const int64_t q_size = Hq * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
    uint16_t *hidden = s->hidden, *normed = s->normed, *qkv = s->qkv;
    const int threads = s->threads;

    if (first) {
        memcpy(s->residual, hidden, sizeof(uint16_t) * T * H);
        rmsnorm_rows(hidden, H, NULL, 0, layer->input_norm, T, H, s->eps, BF16, normed, NULL,
                     threads);
    } else {  // the residual is updated in place: each element is read before it is written
        rmsnorm_rows(hidden, H, s->residual, H, layer->input_norm, T, H, s->eps, BF16, normed,
                     s->residual, threads);
    }
    if (amx_linear_bf16(normed, H, T, layer->qkv, qkv_size, H, layer->qkv_bias, qkv, threads))
        return -1;
    rope_and_store(qkv, qkv_size, qkv + q_size + kv_size, qkv_size, s->cos, s->sin, T, Hq, Hkv,
                   D, BF16, s->q, s->k, layer->k_cache, layer->v_cache, s->slots, threads);
    if (paged_decode_attention(s->q, BF16, q_size, layer->k_cache, layer->v_cache, BF16, NULL,
                               NULL, s->block_tables, s->table_width, s->context_lens, T, Hq,
                               Hkv, D, s->block_size, s->softmax_scale, s->attention, threads))
        return -2;
    if (amx_linear_bf16(s->attention, q_size, T, layer->o, H, q_size, layer->o_bias, hidden,
                        threads))
        return -1;
    rmsnorm_rows(hidden, H, s->residual, H, layer->post_attention_norm, T, H, s->eps, BF16,
                 normed, s->residual, threads);
    if (amx_linear_bf16(normed, H, T, layer->gate_up, 2 * I, H, layer->gate_up_bias,
                        s->gate_up, threads))
        return -1;
    silu_mul_rows(s->gate_up, 2 * I, T, I, BF16, s->activated, threads);
    if (amx_linear_bf16(s->activated, I, T, layer->down, H, I, layer->down_bias, hidden,
                        threads))
        return -1;
    return 0;
}
