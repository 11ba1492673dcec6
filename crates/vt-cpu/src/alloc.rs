//! vt-cpu's allocator: every backend buffer comes from here, so memory is accounted and, in
//! placement-arena mode, freed blocks are handed out again deterministically. The bookkeeping is
//! vt-core's `alloc::Allocator`; this is its host memory (zeroed 64-byte-aligned blocks, 64 MiB
//! arena chunks) and the buffer type.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use vt_core::alloc::RawMemory;
use vt_core::{Error, Result};

pub use vt_core::alloc::AllocMode;

const ALIGN: usize = 64;
const ARENA_CHUNK: usize = 64 << 20;

pub type Allocator = vt_core::alloc::Allocator<HostMemory>;

/// The process heap, zeroed at allocation.
pub struct HostMemory;

/// An arena chunk of the heap, deallocated on drop.
pub struct HostChunk {
    base: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the chunk exclusively owns its memory, plain bytes; it only deallocates it on drop.
unsafe impl Send for HostChunk {}

impl Drop for HostChunk {
    fn drop(&mut self) {
        // SAFETY: allocated with exactly this layout; the allocator drops its chunks only after
        // every buffer (each holds an Arc to it) is gone.
        unsafe { dealloc(self.base.as_ptr(), self.layout) };
    }
}

fn zeroed(size: usize) -> Result<(NonNull<u8>, Layout)> {
    let oom = || Error::backend("cpu", format!("out of memory allocating {size} bytes"));
    let layout = Layout::from_size_align(size, ALIGN).map_err(|_| oom())?;
    // SAFETY: `layout` has non-zero size (the allocator rounds every request up to ALIGN).
    let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(oom)?;
    Ok((ptr, layout))
}

impl RawMemory for HostMemory {
    type Chunk = HostChunk;
    const ALIGN: usize = ALIGN;
    const BACKEND: &'static str = "cpu";

    fn alloc(&self, size: usize) -> Result<u64> {
        Ok(zeroed(size)?.0.as_ptr() as u64)
    }

    unsafe fn free(&self, addr: u64, size: usize) {
        let layout = Layout::from_size_align(size, ALIGN).expect("layout was valid at alloc");
        // SAFETY: `addr` came from `alloc` (`alloc_zeroed` with exactly this layout) and is freed
        // once (the caller's contract).
        unsafe { dealloc(addr as *mut u8, layout) };
    }

    fn chunk(&self, size: usize) -> Result<(u64, usize, HostChunk)> {
        let (base, layout) = zeroed(size.max(ARENA_CHUNK))?;
        Ok((base.as_ptr() as u64, layout.size(), HostChunk { base, layout }))
    }
}

/// A block of backend memory. It keeps its allocator alive and frees itself on drop.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len: usize,
    size: usize,
    alloc: Arc<Allocator>,
}

// SAFETY: the buffer exclusively owns its block; `&CpuBuffer` only hands out shared reads.
unsafe impl Send for CpuBuffer {}
// SAFETY: as above.
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    pub(crate) fn new(alloc: &Arc<Allocator>, len: usize) -> Result<Self> {
        let block = alloc.alloc(len)?;
        let ptr = NonNull::new(block.addr as *mut u8).expect("host blocks are non-null");
        if block.reused {
            // SAFETY: the block holds `size` bytes of ours that nothing else uses (freed, and now
            // handed to this buffer alone); fresh blocks are zeroed already.
            unsafe { ptr.as_ptr().write_bytes(0, block.size) };
        }
        Ok(CpuBuffer { ptr, len, size: block.size, alloc: alloc.clone() })
    }

    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `size >= len` bytes, initialised (zeroed at allocation) and
        // exclusively owned by this buffer for its lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` guarantees no other reference exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as f32s (64-byte alignment makes the cast valid; the length must divide).
    pub fn f32s(&self) -> &[f32] {
        bytemuck::cast_slice(self.bytes())
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        // SAFETY: the block `new` got from this allocator, given back once.
        unsafe { self.alloc.free(self.ptr.as_ptr() as u64, self.size) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vt_core::MemoryStats;

    #[test]
    fn arena_replays_placement_and_accounts() {
        let a = Arc::new(Allocator::new(AllocMode::PlacementArena, HostMemory));
        let sizes = [100, 4096, 100, 64, 4096, 7];
        let first: Vec<CpuBuffer> = sizes.iter().map(|&s| CpuBuffer::new(&a, s).unwrap()).collect();
        let addrs: Vec<usize> = first.iter().map(CpuBuffer::addr).collect();
        assert_eq!(a.stats().blocks_live, sizes.len());
        drop(first);
        assert_eq!(a.stats().bytes_live, 0);
        assert_eq!(a.stats().blocks_live, 0);
        let second: Vec<CpuBuffer> = sizes.iter().map(|&s| CpuBuffer::new(&a, s).unwrap()).collect();
        assert_eq!(second.iter().map(CpuBuffer::addr).collect::<Vec<_>>(), addrs);
        assert!(second.iter().all(|b| b.bytes().iter().all(|&x| x == 0)), "reused blocks are zeroed");
    }

    #[test]
    fn system_mode_returns_memory() {
        let a = Arc::new(Allocator::new(AllocMode::System, HostMemory));
        let b = CpuBuffer::new(&a, 1000).unwrap();
        assert_eq!(a.stats().bytes_live, 1024);
        drop(b);
        assert_eq!(a.stats(), MemoryStats { bytes_live: 0, blocks_live: 0, peak_bytes: 1024 });
    }
}
