//! vt-cuda's device allocator: every backend buffer comes from here, so device memory is
//! accounted and, in placement-arena mode, freed blocks are handed out again deterministically.
//! The bookkeeping is vt-core's `alloc::Allocator`; this is its device memory and the buffer type.
//!
//! System mode takes each block from the driver's stream-ordered allocator (`cuMemAllocAsync`) and
//! frees it in stream order; the default pool's release threshold of 0 hands freed memory back to
//! the driver at the next synchronisation, so `cuMemGetInfo` returns to its baseline.
//!
//! Arena mode carves 256-byte-aligned blocks from 64 MiB chunks (`cuMemAlloc`) that stay until the
//! backend is dropped. All work of one backend is ordered on its one stream, so a freed block may
//! be reused at once.
//!
//! A recording's allocator (`for_recording`) works as an arena whose chunks are blocks of its
//! parent: what a recorded step allocates stays reserved for its replays, and goes back to the
//! parent, in the parent's stream order, when the recording is dropped.

use std::sync::Arc;

use cudarc::driver::{result, CudaStream};
use vt_core::alloc::RawMemory;
use vt_core::Result;

use crate::error::driver_err;

pub use vt_core::alloc::AllocMode;

const ALIGN: usize = 256;
const ARENA_CHUNK: usize = 64 << 20;
/// Smallest chunk of a recording's arena (a decode step's scratch is a few MiB).
const RECORDING_CHUNK: usize = 4 << 20;

pub type Allocator = vt_core::alloc::Allocator<DeviceMemory>;

/// A device's memory, ordered on one stream.
pub struct DeviceMemory {
    stream: Arc<CudaStream>,
    /// Where a recording's arena takes its chunks.
    parent: Option<Arc<Allocator>>,
}

impl DeviceMemory {
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(|e| driver_err("bind context", e))
    }
}

/// A backend's allocator in `mode` on `stream`.
pub fn new_allocator(mode: AllocMode, stream: Arc<CudaStream>) -> Allocator {
    Allocator::new(mode, DeviceMemory { stream, parent: None })
}

/// An arena on `stream` (a recording's) whose chunks are blocks of `parent`.
pub fn for_recording(parent: &Arc<Allocator>, stream: Arc<CudaStream>) -> Allocator {
    Allocator::new(AllocMode::PlacementArena, DeviceMemory { stream, parent: Some(parent.clone()) })
}

/// An arena chunk: a block of the parent (a recording's), freed in the parent's stream order when
/// dropped, or driver memory, freed once the stream is idle.
pub enum DeviceChunk {
    Parent { _block: CudaBuffer },
    Driver { base: u64, stream: Arc<CudaStream> },
}

impl Drop for DeviceChunk {
    fn drop(&mut self) {
        let DeviceChunk::Driver { base, stream } = self else { return };
        // The allocator drops its chunks after every buffer; queued work may still read them. A
        // failure means the context is gone, and the memory with it.
        if stream.context().bind_to_thread().is_err() || stream.synchronize().is_err() {
            return;
        }
        // SAFETY: `base` came from `malloc_sync`, no buffer is live and the stream is idle.
        let _ = unsafe { result::free_sync(*base) };
    }
}

impl RawMemory for DeviceMemory {
    type Chunk = DeviceChunk;
    const ALIGN: usize = ALIGN;
    const BACKEND: &'static str = "cuda";

    fn alloc(&self, size: usize) -> Result<u64> {
        self.bind()?;
        // SAFETY: the stream is alive (we hold it) and its context is bound to this thread.
        unsafe { result::malloc_async(self.stream.cu_stream(), size) }
            .map_err(|e| driver_err(&format!("allocating {size} bytes"), e))
    }

    unsafe fn free(&self, addr: u64, _size: usize) {
        // A failure here means the context is gone; there is nothing left to free into.
        if self.bind().is_ok() {
            // SAFETY: `addr` came from `malloc_async` and is freed once (the caller's contract);
            // work already queued on the stream that reads it runs first.
            let _ = unsafe { result::free_async(addr, self.stream.cu_stream()) };
        }
    }

    fn chunk(&self, size: usize) -> Result<(u64, usize, DeviceChunk)> {
        if let Some(p) = &self.parent {
            let block = CudaBuffer::new(p, size.max(RECORDING_CHUNK))?;
            return Ok((block.ptr(), block.len(), DeviceChunk::Parent { _block: block }));
        }
        let chunk_size = size.max(ARENA_CHUNK);
        self.bind()?;
        // SAFETY: the backend's context is bound to this thread.
        let base = unsafe { result::malloc_sync(chunk_size) }
            .map_err(|e| driver_err(&format!("allocating an arena chunk of {chunk_size} bytes"), e))?;
        Ok((base, chunk_size, DeviceChunk::Driver { base, stream: self.stream.clone() }))
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
        let block = alloc.alloc(len)?;
        Ok(CudaBuffer { ptr: block.addr, len, size: block.size, alloc: alloc.clone() })
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
        // SAFETY: the block `new` got from this allocator, given back once; work queued on the
        // stream that reads it runs before the block is reused or freed (stream order).
        unsafe { self.alloc.free(self.ptr, self.size) };
    }
}
