//! vt-cpu's allocator: every backend buffer comes from here, so memory is accounted and, in
//! placement-arena mode, freed blocks are handed out again deterministically.
//!
//! Arena mode carves blocks from large chunks in address order and never returns them to the
//! system while the backend lives. A request is served by the lowest-addressed free block of
//! exactly its (64-byte-rounded) size, else carved fresh. Replaying the same sequence of requests
//! after everything was freed therefore lands every block at exactly the address it had before:
//! that is how the lifetime tests *command* address reuse instead of hoping for it. (Not LIFO: Rust
//! drops fields and `Vec` elements front to back, so same-sized blocks are freed in allocation order
//! and a LIFO free list would hand them out reversed on one round and restored on the next.)

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::{BTreeSet, HashMap};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use vt_core::{Error, MemoryStats, Result};

const ALIGN: usize = 64;
const ARENA_CHUNK: usize = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocMode {
    /// Each block from the system allocator, returned on free.
    System,
    /// Deterministic reuse of freed blocks (see the module docs).
    PlacementArena,
}

struct Chunk {
    base: NonNull<u8>,
    layout: Layout,
    used: usize,
}

#[derive(Default)]
struct State {
    stats: MemoryStats,
    chunks: Vec<Chunk>,
    /// size -> free block addresses (arena mode).
    free: HashMap<usize, BTreeSet<usize>>,
}

pub struct Allocator {
    mode: AllocMode,
    state: Mutex<State>,
}

// SAFETY: the raw chunk pointers in `State` are only touched under the mutex, and the memory they
// point to is plain bytes owned by this allocator.
unsafe impl Send for Allocator {}
// SAFETY: as above; all shared access goes through the mutex.
unsafe impl Sync for Allocator {}

impl Allocator {
    pub fn new(mode: AllocMode) -> Self {
        Allocator { mode, state: Mutex::new(State::default()) }
    }

    pub fn mode(&self) -> AllocMode {
        self.mode
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters half-updated in a way that
        // matters more than losing the allocator, so recover the guard.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// A zeroed block of at least `len` bytes (64-byte aligned); returns the pointer and the
    /// rounded size that `free` must be given back.
    fn alloc(&self, len: usize) -> Result<(NonNull<u8>, usize)> {
        let size = len.max(1).checked_next_multiple_of(ALIGN).ok_or_else(|| oom(len))?;
        let mut st = self.lock();
        let ptr = match self.mode {
            AllocMode::System => {
                let layout = Layout::from_size_align(size, ALIGN).map_err(|_| oom(len))?;
                // SAFETY: `layout` has non-zero size.
                NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(|| oom(len))?
            }
            AllocMode::PlacementArena => {
                let reused = st.free.get_mut(&size).and_then(|set| set.pop_first());
                match reused {
                    Some(addr) => {
                        let ptr = addr as *mut u8;
                        // SAFETY: `addr` is a block of `size` bytes inside one of our chunks that
                        // was freed and is not handed out to anyone else.
                        unsafe { ptr.write_bytes(0, size) };
                        NonNull::new(ptr).expect("arena blocks are non-null")
                    }
                    None => carve(&mut st, size).ok_or_else(|| oom(len))?,
                }
            }
        };
        st.stats.bytes_live += size;
        st.stats.blocks_live += 1;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.bytes_live);
        Ok((ptr, size))
    }

    /// Gives a block back. Called only by `CpuBuffer::drop` with what `alloc` returned.
    fn free(&self, ptr: NonNull<u8>, size: usize) {
        let mut st = self.lock();
        st.stats.bytes_live -= size;
        st.stats.blocks_live -= 1;
        match self.mode {
            AllocMode::System => {
                let layout = Layout::from_size_align(size, ALIGN).expect("layout was valid at alloc");
                // SAFETY: `ptr` was allocated by `alloc_zeroed` with exactly this layout and is
                // freed once, by its owning buffer's drop.
                unsafe { dealloc(ptr.as_ptr(), layout) };
            }
            AllocMode::PlacementArena => {
                st.free.entry(size).or_default().insert(ptr.as_ptr() as usize);
            }
        }
    }
}

/// Carves `size` bytes from the newest chunk, or from a new one.
fn carve(st: &mut State, size: usize) -> Option<NonNull<u8>> {
    if let Some(chunk) = st.chunks.last_mut() {
        if chunk.layout.size() - chunk.used >= size {
            // SAFETY: `used + size <= chunk size`, so the result stays inside the chunk.
            let ptr = unsafe { chunk.base.as_ptr().add(chunk.used) };
            chunk.used += size;
            return NonNull::new(ptr);
        }
    }
    let layout = Layout::from_size_align(size.max(ARENA_CHUNK), ALIGN).ok()?;
    // SAFETY: non-zero size.
    let base = NonNull::new(unsafe { alloc_zeroed(layout) })?;
    st.chunks.push(Chunk { base, layout, used: size });
    Some(base)
}

fn oom(len: usize) -> Error {
    Error::backend("cpu", format!("out of memory allocating {len} bytes"))
}

impl Drop for Allocator {
    fn drop(&mut self) {
        // Every buffer holds an Arc to us, so no block is live here.
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for chunk in st.chunks.drain(..) {
            // SAFETY: each chunk was allocated with exactly this layout and no buffer is live.
            unsafe { dealloc(chunk.base.as_ptr(), chunk.layout) };
        }
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
        let (ptr, size) = alloc.alloc(len)?;
        Ok(CpuBuffer { ptr, len, size, alloc: alloc.clone() })
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
        self.alloc.free(self.ptr, self.size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_replays_placement_and_accounts() {
        let a = Arc::new(Allocator::new(AllocMode::PlacementArena));
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
        let a = Arc::new(Allocator::new(AllocMode::System));
        let b = CpuBuffer::new(&a, 1000).unwrap();
        assert_eq!(a.stats().bytes_live, 1024);
        drop(b);
        assert_eq!(a.stats(), MemoryStats { bytes_live: 0, blocks_live: 0, peak_bytes: 1024 });
    }
}
