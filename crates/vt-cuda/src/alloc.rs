//! vt-cuda's device allocator: every backend buffer comes from here, so device memory is
//! accounted and, in placement-arena mode, freed blocks are handed out again deterministically.
//!
//! System mode takes each block from the driver's stream-ordered allocator (`cuMemAllocAsync`) and
//! frees it in stream order; the default pool's release threshold of 0 hands freed memory back to
//! the driver at the next synchronisation, so `cuMemGetInfo` returns to its baseline.
//!
//! Arena mode follows vt-cpu's `alloc.rs`: blocks are carved in address order from 64 MiB chunks
//! (`cuMemAlloc`) that stay until the backend is dropped, and a request is served by the
//! lowest-addressed free block of exactly its (256-byte-rounded) size, else carved fresh. All work
//! of one backend is ordered on its one stream, so a freed block may be reused at once.
//!
//! A recording's allocator (`Allocator::for_recording`) works as an arena whose chunks are blocks
//! of its parent: what a recorded step allocates stays reserved for its replays, and goes back to
//! the parent, in the parent's stream order, when the recording is dropped.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result, CudaStream};
use vt_core::{Error, MemoryStats, Result};

use crate::error::driver_err;

const ALIGN: usize = 256;
const ARENA_CHUNK: usize = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocMode {
    /// Each block from the driver's stream-ordered allocator, returned on free.
    System,
    /// Deterministic reuse of freed blocks (see the module docs).
    PlacementArena,
}

struct Chunk {
    base: u64,
    size: usize,
    used: usize,
    /// The parent's block this chunk is (a recording's arena); `None`: from the driver.
    block: Option<CudaBuffer>,
}

/// Smallest chunk of a recording's arena (a decode step's scratch is a few MiB).
const RECORDING_CHUNK: usize = 4 << 20;

#[derive(Default)]
struct State {
    stats: MemoryStats,
    chunks: Vec<Chunk>,
    /// size -> free block addresses (arena mode).
    free: HashMap<usize, BTreeSet<u64>>,
}

pub struct Allocator {
    mode: AllocMode,
    stream: Arc<CudaStream>,
    state: Mutex<State>,
    /// Where a recording's arena takes its chunks.
    parent: Option<Arc<Allocator>>,
}

impl Allocator {
    pub fn new(mode: AllocMode, stream: Arc<CudaStream>) -> Self {
        Allocator { mode, stream, state: Mutex::new(State::default()), parent: None }
    }

    /// An arena on `stream` (a recording's) whose chunks are blocks of `parent`.
    pub fn for_recording(parent: &Arc<Allocator>, stream: Arc<CudaStream>) -> Self {
        Allocator {
            mode: AllocMode::PlacementArena,
            stream,
            state: Mutex::new(State::default()),
            parent: Some(parent.clone()),
        }
    }

    pub fn mode(&self) -> AllocMode {
        self.mode
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counters are updated together under the lock; a panic elsewhere cannot tear them.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// A block of at least `len` bytes (256-byte aligned, contents undefined); returns its device
    /// address and the rounded size that `free` must be given back.
    fn alloc(&self, len: usize) -> Result<(u64, usize)> {
        let size = len.max(1).checked_next_multiple_of(ALIGN).ok_or_else(|| oom(len))?;
        self.stream.context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        let mut st = self.lock();
        let ptr = match self.mode {
            // SAFETY: the stream is alive (we hold it) and its context is bound to this thread.
            AllocMode::System => unsafe { result::malloc_async(self.stream.cu_stream(), size) }
                .map_err(|e| driver_err(&format!("allocating {size} bytes"), e))?,
            AllocMode::PlacementArena => match st.free.get_mut(&size).and_then(|set| set.pop_first()) {
                Some(addr) => addr,
                None => carve(&mut st, size, self.parent.as_ref())?,
            },
        };
        st.stats.bytes_live += size;
        st.stats.blocks_live += 1;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.bytes_live);
        Ok((ptr, size))
    }

    /// Gives a block back. Called only by `CudaBuffer::drop` with what `alloc` returned.
    fn free(&self, ptr: u64, size: usize) {
        let mut st = self.lock();
        st.stats.bytes_live -= size;
        st.stats.blocks_live -= 1;
        match self.mode {
            AllocMode::System => {
                // A failure here means the context is gone; there is nothing left to free into.
                if self.stream.context().bind_to_thread().is_ok() {
                    // SAFETY: `ptr` came from `malloc_async` and is freed once, by its buffer's
                    // drop; work already queued on the stream that reads it runs first.
                    let _ = unsafe { result::free_async(ptr, self.stream.cu_stream()) };
                }
            }
            AllocMode::PlacementArena => {
                st.free.entry(size).or_default().insert(ptr);
            }
        }
    }
}

/// Carves `size` bytes from the newest chunk, or from a new one (a block of `parent` if given).
fn carve(st: &mut State, size: usize, parent: Option<&Arc<Allocator>>) -> Result<u64> {
    if let Some(chunk) = st.chunks.last_mut() {
        if chunk.size - chunk.used >= size {
            let ptr = chunk.base + chunk.used as u64;
            chunk.used += size;
            return Ok(ptr);
        }
    }
    let chunk = match parent {
        Some(p) => {
            let block = CudaBuffer::new(p, size.max(RECORDING_CHUNK))?;
            Chunk { base: block.ptr(), size: block.len(), used: size, block: Some(block) }
        }
        None => {
            let chunk_size = size.max(ARENA_CHUNK);
            // SAFETY: the caller bound the backend's context to this thread.
            let base = unsafe { result::malloc_sync(chunk_size) }
                .map_err(|e| driver_err(&format!("allocating an arena chunk of {chunk_size} bytes"), e))?;
            Chunk { base, size: chunk_size, used: size, block: None }
        }
    };
    let base = chunk.base;
    st.chunks.push(chunk);
    Ok(base)
}

fn oom(len: usize) -> Error {
    Error::backend("cuda", format!("out of memory allocating {len} bytes"))
}

impl Drop for Allocator {
    fn drop(&mut self) {
        // Every buffer holds an Arc to us, so no block is live; queued work may still read them.
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        // A recording's chunks are the parent's blocks: dropping them frees them in its order.
        st.chunks.retain(|c| c.block.is_none());
        if st.chunks.is_empty() || self.stream.context().bind_to_thread().is_err() || self.stream.synchronize().is_err()
        {
            return;
        }
        for chunk in st.chunks.drain(..) {
            // SAFETY: each chunk came from `malloc_sync`, no buffer is live and the stream is idle.
            let _ = unsafe { result::free_sync(chunk.base) };
        }
    }
}

/// A block of device memory. It keeps its allocator (and so the stream and context) alive and
/// frees itself on drop.
pub struct CudaBuffer {
    ptr: u64,
    len: usize,
    size: usize,
    alloc: Arc<Allocator>,
}

impl CudaBuffer {
    pub(crate) fn new(alloc: &Arc<Allocator>, len: usize) -> Result<Self> {
        let (ptr, size) = alloc.alloc(len)?;
        Ok(CudaBuffer { ptr, len, size, alloc: alloc.clone() })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes requested (the block may be larger).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.alloc.free(self.ptr, self.size);
    }
}
