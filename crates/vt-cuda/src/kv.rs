//! An engine's KV block pool in device memory (`vt_core::backend::kv`): per attention layer, keys
//! and values each `[blocks, KV_BLOCK, kv_heads, head_dim]` bf16, taken when the pool is made and
//! never moved, so a recorded step may keep their addresses. The attention kernels find a
//! sequence's positions through its block table (kernels/kv_blocks.cuh); which blocks are free is
//! the host's business.

use cudarc::driver::result;
use vt_core::{KvLayout, KvSeq, Result};

use crate::alloc::CudaBuffer;
use crate::device::CudaBackend;
use crate::error::{check, driver_err};
use crate::limits::KV_BLOCK;

pub struct CudaKvPool {
    layers: Vec<KvStore>,
}

/// One attention layer's keys and values.
pub(crate) struct KvStore {
    pub(crate) layout: KvLayout,
    keys: CudaBuffer,
    values: CudaBuffer,
}

impl KvStore {
    pub(crate) fn keys(&self) -> u64 {
        self.keys.ptr()
    }

    pub(crate) fn values(&self) -> u64 {
        self.values.ptr()
    }

    fn block_bytes(&self) -> usize {
        KV_BLOCK * self.layout.kv_heads * self.layout.head_dim * 2
    }
}

impl CudaKvPool {
    pub(crate) fn new(b: &CudaBackend, layouts: &[KvLayout]) -> Result<Self> {
        let layers = layouts
            .iter()
            .map(|&layout| {
                // The kernels count a layer's rows in an i32 (kv_blocks.cuh).
                check(layout.blocks * KV_BLOCK <= i32::MAX as usize, "new_kv_pool", || {
                    format!("{} blocks of {KV_BLOCK} positions: the kernels count rows in 31 bits", layout.blocks)
                })?;
                let bytes = layout.blocks * KV_BLOCK * layout.kv_heads * layout.head_dim * 2;
                Ok(KvStore { layout, keys: b.buffer(bytes)?, values: b.buffer(bytes)? })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaKvPool { layers })
    }

    /// The store of `seq`'s layer.
    pub(crate) fn layer(&self, op: &str, seq: &KvSeq<'_>) -> Result<&KvStore> {
        let n = self.layers.len();
        self.layers
            .get(seq.layer)
            .ok_or_else(|| crate::error::err(format!("{op}: layer {} of a pool of {n}", seq.layer)))
    }

    /// Copies block `src` of `layer` over block `dst`, keys and values.
    pub(crate) fn copy_block(&mut self, b: &CudaBackend, layer: usize, src: u32, dst: u32) -> Result<()> {
        let op = "copy_kv_block";
        let n = self.layers.len();
        let store =
            self.layers.get(layer).ok_or_else(|| crate::error::err(format!("{op}: layer {layer} of a pool of {n}")))?;
        let blocks = store.layout.blocks;
        check((src as usize) < blocks && (dst as usize) < blocks, op, || {
            format!("blocks {src} -> {dst} of a layer of {blocks}")
        })?;
        check(b.recording().is_none(), op, || "a recorder does not copy blocks".into())?;
        if src == dst {
            return Ok(());
        }
        let bytes = store.block_bytes();
        b.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        for base in [store.keys(), store.values()] {
            // SAFETY: both blocks lie inside the layer's buffer (ids checked above) and do not
            // overlap (distinct ids); ordered on the stream after every kernel that wrote `src`.
            unsafe {
                result::memcpy_dtod_async(
                    base + dst as u64 * bytes as u64,
                    base + src as u64 * bytes as u64,
                    bytes,
                    b.stream().cu_stream(),
                )
            }
            .map_err(|e| driver_err(op, e))?;
        }
        Ok(())
    }
}
