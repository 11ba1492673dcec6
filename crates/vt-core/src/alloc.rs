//! The allocator bookkeeping every backend shares: accounting, and the placement arena. A backend
//! brings its raw memory (`RawMemory`: host `alloc`, the CUDA driver); this decides where blocks go.
//!
//! System mode takes each block from the raw memory and gives it back on free. Arena mode carves
//! blocks from large chunks in address order and keeps the chunks while the allocator lives. A
//! request is served by the lowest-addressed free block of exactly its (aligned) size, else carved
//! fresh. Replaying the same sequence of requests after everything was freed therefore lands every
//! block at exactly the address it had before: that is how the lifetime tests *command* address
//! reuse instead of hoping for it. (Not LIFO: Rust drops fields and `Vec` elements front to back,
//! so same-sized blocks are freed in allocation order and a LIFO free list would hand them out
//! reversed on one round and restored on the next.)

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};

use crate::{Error, MemoryStats, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocMode {
    /// Each block from the backend's raw memory, returned on free.
    System,
    /// Deterministic reuse of freed blocks (see the module docs).
    PlacementArena,
}

/// A backend's own memory, in its address space (a device's addresses need not be the host's).
pub trait RawMemory: Send + Sync {
    /// Owns one arena chunk; dropping it gives the chunk's memory back.
    type Chunk: Send;
    /// Alignment, and size granularity, of every block.
    const ALIGN: usize;
    /// The backend, as errors name it.
    const BACKEND: &'static str;
    /// A block of `size` bytes (system mode).
    fn alloc(&self, size: usize) -> Result<u64>;
    /// Gives back a block `alloc` returned, with its size.
    ///
    /// # Safety
    /// `addr` and `size` are a block this memory's `alloc` returned, given back once.
    unsafe fn free(&self, addr: u64, size: usize);
    /// A chunk of at least `size` bytes for the arena to carve: its base address, its size and
    /// its owner.
    fn chunk(&self, size: usize) -> Result<(u64, usize, Self::Chunk)>;
}

/// A block handed out: `size` is `len` rounded up, what `free` must be given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    pub size: usize,
    /// A freed arena block handed out again: it still holds what its last owner wrote.
    pub reused: bool,
}

struct Chunk<C> {
    base: u64,
    size: usize,
    used: usize,
    /// Dropped with the allocator, after every block is gone.
    _owner: C,
}

struct State<C> {
    stats: MemoryStats,
    chunks: Vec<Chunk<C>>,
    /// size -> free block addresses (arena mode).
    free: HashMap<usize, BTreeSet<u64>>,
}

pub struct Allocator<R: RawMemory> {
    mode: AllocMode,
    /// Before `raw`: the chunks go back before the memory they came from is dropped.
    state: Mutex<State<R::Chunk>>,
    raw: R,
}

impl<R: RawMemory> Allocator<R> {
    pub fn new(mode: AllocMode, raw: R) -> Self {
        let state = State { stats: MemoryStats::default(), chunks: Vec::new(), free: HashMap::new() };
        Allocator { mode, state: Mutex::new(state), raw }
    }

    pub fn mode(&self) -> AllocMode {
        self.mode
    }

    /// The raw memory blocks come from.
    pub fn raw(&self) -> &R {
        &self.raw
    }

    fn lock(&self) -> MutexGuard<'_, State<R::Chunk>> {
        // Counters are updated together under the lock; a panic elsewhere cannot tear them.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// A block of at least `len` bytes (`R::ALIGN`-aligned).
    pub fn alloc(&self, len: usize) -> Result<Block> {
        let size = len
            .max(1)
            .checked_next_multiple_of(R::ALIGN)
            .ok_or_else(|| Error::backend(R::BACKEND, format!("out of memory allocating {len} bytes")))?;
        let mut st = self.lock();
        let (addr, reused) = match self.mode {
            AllocMode::System => (self.raw.alloc(size)?, false),
            AllocMode::PlacementArena => match st.free.get_mut(&size).and_then(|set| set.pop_first()) {
                Some(addr) => (addr, true),
                None => (self.carve(&mut st, size)?, false),
            },
        };
        st.stats.bytes_live += size;
        st.stats.blocks_live += 1;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.bytes_live);
        Ok(Block { addr, size, reused })
    }

    /// Gives back a block.
    ///
    /// # Safety
    /// `addr` and `size` are a `Block` this allocator's `alloc` returned, given back once, and
    /// nothing uses the block afterwards (in system mode its memory is returned).
    pub unsafe fn free(&self, addr: u64, size: usize) {
        let mut st = self.lock();
        st.stats.bytes_live -= size;
        st.stats.blocks_live -= 1;
        match self.mode {
            // SAFETY: system mode's blocks come from `raw.alloc`; the caller gives each back once.
            AllocMode::System => unsafe { self.raw.free(addr, size) },
            AllocMode::PlacementArena => {
                st.free.entry(size).or_default().insert(addr);
            }
        }
    }

    /// Carves `size` bytes from the newest chunk, or from a new one.
    fn carve(&self, st: &mut State<R::Chunk>, size: usize) -> Result<u64> {
        if let Some(chunk) = st.chunks.last_mut() {
            if chunk.size - chunk.used >= size {
                let addr = chunk.base + chunk.used as u64;
                chunk.used += size;
                return Ok(addr);
            }
        }
        let (base, chunk_size, owner) = self.raw.chunk(size)?;
        st.chunks.push(Chunk { base, size: chunk_size, used: size, _owner: owner });
        Ok(base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    /// Hands out addresses from a counter; counts what is live in it.
    #[derive(Default)]
    struct Counter {
        next: AtomicU64,
        live: AtomicUsize,
    }

    impl RawMemory for Counter {
        type Chunk = ();
        const ALIGN: usize = 64;
        const BACKEND: &'static str = "test";
        fn alloc(&self, size: usize) -> Result<u64> {
            self.live.fetch_add(size, Ordering::Relaxed);
            Ok(self.next.fetch_add(size as u64, Ordering::Relaxed) + 4096)
        }
        unsafe fn free(&self, _: u64, size: usize) {
            self.live.fetch_sub(size, Ordering::Relaxed);
        }
        fn chunk(&self, size: usize) -> Result<(u64, usize, ())> {
            let size = size.max(1 << 16);
            Ok((self.alloc(size)?, size, ()))
        }
    }

    #[test]
    fn arena_replays_placement_and_accounts() {
        let a = Allocator::new(AllocMode::PlacementArena, Counter::default());
        let sizes = [100, 4096, 100, 64, 4096, 7, 1 << 17];
        let first: Vec<Block> = sizes.iter().map(|&s| a.alloc(s).unwrap()).collect();
        assert!(first.iter().all(|b| !b.reused && b.addr % 64 == 0));
        assert_eq!(first.iter().map(|b| b.size).collect::<Vec<_>>(), [128, 4096, 128, 64, 4096, 64, 1 << 17]);
        assert_eq!(a.stats().blocks_live, sizes.len());
        for b in &first {
            // SAFETY: each block once, as `alloc` gave it.
            unsafe { a.free(b.addr, b.size) };
        }
        assert_eq!((a.stats().bytes_live, a.stats().blocks_live), (0, 0));
        let second: Vec<Block> = sizes.iter().map(|&s| a.alloc(s).unwrap()).collect();
        let addrs = |bs: &[Block]| bs.iter().map(|b| b.addr).collect::<Vec<_>>();
        assert_eq!(addrs(&second), addrs(&first));
        assert!(second.iter().all(|b| b.reused));
        // Chunks stay with the arena: two (the big block took its own), nothing returned.
        assert_eq!(a.raw().live.load(Ordering::Relaxed), (1 << 16) + (1 << 17));
    }

    #[test]
    fn system_mode_returns_memory() {
        let a = Allocator::new(AllocMode::System, Counter::default());
        let b = a.alloc(1000).unwrap();
        assert_eq!((a.stats().bytes_live, a.raw().live.load(Ordering::Relaxed)), (1024, 1024));
        // SAFETY: the block `alloc` gave, once.
        unsafe { a.free(b.addr, b.size) };
        assert_eq!(a.stats(), MemoryStats { bytes_live: 0, blocks_live: 0, peak_bytes: 1024 });
        assert_eq!(a.raw().live.load(Ordering::Relaxed), 0);
    }
}
