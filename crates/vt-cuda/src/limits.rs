//! The numbers the launch code and the kernels of `kernels/*.cu` share, stated once: NVRTC gets
//! each as `-D NAME=value` (kernels.rs), so no .cu file repeats one, and the Rust side uses the
//! same name. tools/gpu/check_kernels.py reads them from this file (one `NAME: type = value;` a
//! line, the value a number or an expression of earlier names).
//!
//! Struct layouts the two sides share (`WeightDesc`, `RouteArgs`, `GemvParts`, `SharedDesc`) are
//! checked by NVRTC in kernels.rs's tests (size and every field's offset).

macro_rules! shared {
    ($($(#[$doc:meta])* $name:ident: $t:ty = $v:expr;)*) => {
        $($(#[$doc])* pub(crate) const $name: $t = $v;)*
        /// Every constant above, by name, as NVRTC's defines take it.
        pub(crate) const DEFINES: &[(&str, i64)] = &[$((stringify!($name), $name as i64)),*];
    };
}

shared! {
    /// Dtype codes of a tensor or weight as the kernels take it (`WeightDesc::kind`, `float_code`).
    DT_F32: i32 = 0;
    DT_BF16: i32 = 1;
    DT_F16: i32 = 2;
    DT_NVFP4: i32 = 3;
    DT_FP8: i32 = 4;
    /// Sequences one launch of a batched decode kernel serves (the length of its by-value
    /// `SeqPtrs`); larger batches take several launches.
    SEQ_MAX: usize = 64;
    /// Positions per block of the KV pool (kernels/kv_blocks.cuh); the flash kernels' key tile.
    KV_BLOCK: usize = 64;
    /// Experts and top-k of the routing (kernels/route.cuh: `ROUTE_MAX_EXP / 32` choice values a
    /// lane, a choice per lane).
    ROUTE_MAX_EXP: usize = 512;
    ROUTE_MAX_K: usize = 32;
    /// Largest head dimension of the one-warp attention kernel (attention.cu).
    ATT_MAX_D: usize = 256;
    /// Largest causal conv1d kernel (taps), gdn.cu and gdn_decode.cu.
    CONV_MAX_K: usize = 16;
    /// Rotary inverse frequencies a rope launch takes by value (`RopeFreqs`).
    ROPE_MAX_FREQS: usize = 128;
    /// Values each `argmax_part` thread loads per round.
    ARGMAX_LOADS: usize = 8;
    /// Most tokens of one GEMV call on CUDA cores, and on tensor cores (two 8-token MMA column
    /// tiles); most weights of one launch; rows per warp of the CUDA-core kernels; warps of a
    /// tensor-core block.
    GEMV_MAX_T: usize = 8;
    GEMV_MMA_MAX_T: usize = 16;
    GEMV_MAX_PARTS: usize = 4;
    GEMV_ROWS: usize = 2;
    GEMV_MMA_WARPS: usize = 8;
    /// Most tokens of the fused MoE decode block (past GEMV_MAX_T its logits take the tensor-core
    /// GEMV), the bf16 down kernel's threads and resident blocks per SM, and the same for its
    /// one-token instance.
    MOE_DEC_MAX_T: usize = 16;
    MOE_DEC_THREADS: usize = 256;
    MOE_DEC_WAVE_BF16: usize = 4;
    MOE_DEC_T1_THREADS: usize = 512;
    MOE_DEC_T1_WAVE_BF16: usize = 2;
    /// Warps of a bf16 MoE gate/up block (a unit each).
    MOE_DEC_GU_WARPS: usize = 4;
    /// Largest head dimension of the decode attention kernels, and threads of their combine.
    ATT_DEC_MAX_D: usize = 256;
    ATT_DEC_COMBINE_THREADS: usize = 1024;
    /// Keys per shared-memory tile of the flash attention kernels: one block of the KV pool.
    FA_BN: usize = KV_BLOCK;
    /// The chunked gated delta rule: tokens per chunk, key dim, value columns per scan block.
    GC: usize = 64;
    GDK: usize = 128;
    GS_BV: usize = 32;
    /// The decode gated delta rule: key and value dim, value columns per block.
    GDN_D: usize = 128;
    GDN_COLS: usize = 32;
    /// Most positions a sequence steps in one call of the decode gated delta rule (the length of
    /// its by-value `GdnWaves`): a verification of up to GDN_WAVES_MAX - 1 drafts.
    GDN_WAVES_MAX: usize = 32;
    /// The conv taps of the one-launch decode step (gdn_dec_step: each thread keeps its channels'
    /// windows in registers, every index a constant); other counts take gdn_dec_conv then
    /// gdn_dec_state.
    GDN_FUSED_TAPS: usize = 4;
    /// The grouped MoE prefill GEMMs (moe_prefill.cu): slots and weight rows per tile, inputs per
    /// pipeline stage, stages, threads.
    MP_BM: usize = 64;
    MP_BN: usize = 128;
    MP_BK: usize = 64;
    MP_STAGES: usize = 3;
    MP_THREADS: usize = 128;
    /// NVFP4 weights on the device (kernels/nvfp4.cuh, nvfp4.rs): rows and inputs of a tile.
    NV4_ROWS: usize = 16;
    NV4_K: usize = 64;
    /// The NVFP4 decode kernels' shape (kernels/gemv.cu, moe_decode.cu), which decode_bench's
    /// `nv4` case sweeps (`CudaBackend::with_kernel_defines`): k tiles a GEMV warp has in flight
    /// and most warps of its block (a 16-row block, its warps splitting k: vt-cuda gives a warp
    /// about GEMV_NV4_TILES tiles); warps of a MoE gate/up block and the tiles of each weight a
    /// warp has in flight; warps of a MoE down block and the tiles each has in flight.
    GEMV_NV4_TILES: usize = 4;
    GEMV_NV4_MAX_WARPS: usize = 16;
    /// One token's NVFP4 GEMV with its weights in shared memory (gemv_nvfp4_t1s): warps of a
    /// block, and most row blocks a block takes (its static partial sums).
    GEMV_NV4S_WARPS: usize = 16;
    GEMV_NV4S_MAX_PER: usize = 12;
    MOE_NV4_WARPS: usize = 8;
    MOE_NV4_U: usize = 4;
    MOE_NV4_DOWN_WARPS: usize = 8;
    MOE_NV4_DOWN_U: usize = 9;
    /// The same for one token, whose 128 down blocks (Qwen3.5's hidden 2048) are the launch:
    /// 16 warps of 5 tiles took 21.0 µs a MoE layer against 23.5 with 8 of 9, and lost to them
    /// from 4 tokens on (docs/performance.md).
    MOE_NV4_DOWN1_WARPS: usize = 16;
    MOE_NV4_DOWN1_U: usize = 5;
    /// Warps of MoE gate/up blocks the NVFP4 kernel's registers leave room for on one SM (its
    /// launch bound: MOE_NV4_SM_WARPS / MOE_NV4_WARPS blocks): 24 lets all 288 blocks of
    /// Qwen3.5's 8 + 1 slots be resident at once (80 registers a thread).
    MOE_NV4_SM_WARPS: usize = 24;
    /// NVFP4 on tensor cores for prefill (w4a16.cu): weight rows of a block's tile (8 row blocks),
    /// pipeline stages, and a grouped MoE tile's 32-slot row groups (32 * W4_MOE_MI slots a tile).
    W4_BN: usize = 128;
    W4_STAGES: usize = 4;
    W4_MOE_MI: usize = 4;
    /// Tokens from which an NVFP4 dense linear expands its weight to bf16 (exact, w4a16.cu's
    /// nvfp4_dequant) and runs cuBLASLt's GEMM instead of the W4A16 kernel (prefill_bench's
    /// `linear` case measures both).
    NV4_DEQUANT_FROM_T: usize = 512;
}
