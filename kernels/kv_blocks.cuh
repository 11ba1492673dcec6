// The paged KV store the attention kernels read and write (attention.cu, flash_attn.cu,
// attn_decode.cu): per attention layer, keys and values each [blocks, KV_BLOCK, kv_heads, d] bf16,
// shared by every sequence of an engine. A sequence's block table (i32) names the block of each
// KV_BLOCK positions: position p sits in block table[p / KV_BLOCK], row p % KV_BLOCK. Entries of a
// sliding-window layer's blocks wholly outside its window may be released (-1): no kernel reads a
// position no query of its launch sees. A store's rows (block * KV_BLOCK + row) are counted in an
// int.

// Offset (elements) of position p's row, of `row` = kv_heads * d values, in the store.
__device__ __forceinline__ long long kv_row_at(const int* table, int p, long long row) {
    return (long long)(table[p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK) * row;
}
