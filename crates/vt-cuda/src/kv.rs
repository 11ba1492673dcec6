//! One attention layer's bf16 keys and values for one sequence, in device memory.
//!
//! Full attention keeps position p in row p and grows by doubling; a sliding-window layer keeps a
//! ring of `window` rows (position p in row p % window), so it never grows past the window.

use std::sync::Arc;

use cudarc::driver::result;
use vt_core::Result;

use crate::alloc::{Allocator, CudaBuffer};
use crate::capture::RecordedCache;
use crate::error::driver_err;

/// Fewest rows a full-attention cache allocates.
pub(crate) const MIN_ROWS: usize = 16;

pub struct CudaKvCache {
    alloc: Arc<Allocator>,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: Option<usize>,
    k: Option<CudaBuffer>,
    v: Option<CudaBuffer>,
    /// Rows the buffers hold.
    pub(crate) capacity: usize,
    /// Positions seen so far.
    pub(crate) len: usize,
}

impl CudaKvCache {
    pub(crate) fn new(alloc: Arc<Allocator>, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
        CudaKvCache { alloc, kv_heads, head_dim, window, k: None, v: None, capacity: 0, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows of device memory held (the window for a sliding layer, at most).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn row_bytes(&self) -> usize {
        self.kv_heads * self.head_dim * 2
    }

    /// Whether `positions` positions fit without moving the storage.
    pub(crate) fn fits(&self, positions: usize) -> bool {
        match self.window {
            Some(_) => self.k.is_some(),
            None => positions <= self.capacity,
        }
    }

    /// The storage as a recorded step sees it (`None` before any is allocated); a ring never
    /// moves, so any position fits it.
    pub(crate) fn recorded(&self) -> Option<RecordedCache> {
        let keys = self.k.as_ref()?.ptr();
        Some(RecordedCache { keys, capacity: if self.window.is_some() { usize::MAX } else { self.capacity } })
    }

    /// Makes room for `len + t` positions; returns the (keys, values) device addresses.
    pub(crate) fn reserve(&mut self, t: usize) -> Result<(u64, u64)> {
        self.reserve_total(self.len + t)?;
        let (k, v) = (self.k.as_ref().expect("reserved"), self.v.as_ref().expect("reserved"));
        Ok((k.ptr(), v.ptr()))
    }

    /// Moves the storage, if it must, so that it holds `rows` positions (at least twice what it
    /// held, so that a growing sequence moves it rarely).
    pub(crate) fn reserve_total(&mut self, rows: usize) -> Result<()> {
        if !self.fits(rows) {
            let cap = match self.window {
                Some(w) => w,
                None => rows.max(self.capacity * 2).max(MIN_ROWS),
            };
            let k = CudaBuffer::new(&self.alloc, cap * self.row_bytes())?;
            let v = CudaBuffer::new(&self.alloc, cap * self.row_bytes())?;
            if let (Some(ok), Some(ov)) = (&self.k, &self.v) {
                let used = self.capacity * self.row_bytes();
                for (dst, src) in [(&k, ok), (&v, ov)] {
                    // SAFETY: both blocks hold at least `used` bytes; the copy is ordered on the
                    // backend's stream before the old block can be reused.
                    unsafe {
                        result::memcpy_dtod_async(dst.ptr(), src.ptr(), used, self.alloc.raw().stream().cu_stream())
                    }
                    .map_err(|e| driver_err("growing a KV cache", e))?;
                }
            }
            self.k = Some(k);
            self.v = Some(v);
            self.capacity = cap;
        }
        Ok(())
    }
}
