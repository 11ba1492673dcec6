//! Device memory: wgpu buffers behind vt-core's shared `Allocator`, so accounting and the
//! placement arena are the same as on the other backends.
//!
//! wgpu has no addresses, so this gives its buffers some, from their device's range (unique in
//! the process, never reused). Every block is a wgpu buffer of its own (wgpu tracks a buffer's use as a
//! whole: an op may not read one part of a buffer while it writes another). System mode makes
//! one per `alloc` and drops it on `free`. Arena mode's chunks are address ranges only: a block
//! carved from one gets its buffer when first handed out and keeps it, so a freed block of a size
//! class handed out again is the same buffer at the same address; a chunk's buffers go when the
//! arena drops it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use vt_core::alloc::RawMemory;
use vt_core::Result;

use crate::gpu::{err, Gpu, Range};

pub use vt_core::alloc::AllocMode;

/// Alignment and size granularity of every block (what copies and bindings need, with room).
const ALIGN: usize = 256;
/// The arena's chunk size, in addresses (a larger request gets a chunk of its own).
const ARENA_CHUNK: usize = 1 << 30;

pub type Allocator = vt_core::alloc::Allocator<GpuMemory>;

type Buffers = Arc<Mutex<BTreeMap<u64, wgpu::Buffer>>>;

fn lock(r: &Buffers) -> MutexGuard<'_, BTreeMap<u64, wgpu::Buffer>> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

/// The device's buffers, by the address this gave each.
pub struct GpuMemory {
    pub(crate) gpu: Arc<Gpu>,
    buffers: Buffers,
}

/// An arena chunk: an address range whose blocks' buffers go with it.
pub struct GpuChunk {
    buffers: Buffers,
    base: u64,
    size: u64,
}

impl Drop for GpuChunk {
    fn drop(&mut self) {
        lock(&self.buffers).retain(|&addr, _| !(self.base..self.base + self.size).contains(&addr));
    }
}

impl GpuMemory {
    pub(crate) fn new(gpu: Arc<Gpu>) -> Self {
        GpuMemory { gpu, buffers: Arc::default() }
    }

    fn create(&self, size: usize) -> Result<wgpu::Buffer> {
        let max = self.gpu.limits.max_buffer_size;
        if size as u64 > max {
            return Err(err(format!("a buffer of {size} bytes exceeds the adapter's limit of {max}")));
        }
        self.gpu.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: size as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// The buffer of the block at `addr`: the one it has, or (a block freshly carved from an arena
    /// chunk) a new one.
    fn buffer(&self, addr: u64, size: usize) -> Result<wgpu::Buffer> {
        if let Some(b) = lock(&self.buffers).get(&addr) {
            return Ok(b.clone());
        }
        let b = self.create(size)?;
        lock(&self.buffers).insert(addr, b.clone());
        Ok(b)
    }
}

impl RawMemory for GpuMemory {
    type Chunk = GpuChunk;
    const ALIGN: usize = ALIGN;
    const BACKEND: &'static str = "wgpu";

    fn alloc(&self, size: usize) -> Result<u64> {
        let buffer = self.create(size)?;
        let addr = self.gpu.addresses(size);
        lock(&self.buffers).insert(addr, buffer);
        Ok(addr)
    }

    unsafe fn free(&self, addr: u64, _size: usize) {
        // wgpu keeps the buffer alive while recorded commands still use it.
        lock(&self.buffers).remove(&addr);
    }

    fn chunk(&self, size: usize) -> Result<(u64, usize, GpuChunk)> {
        let size = size.max(ARENA_CHUNK);
        let base = self.gpu.addresses(size);
        Ok((base, size, GpuChunk { buffers: self.buffers.clone(), base, size: size as u64 }))
    }
}

/// A block of device memory, or a part of one (a stacked expert's matrix: moe.rs). It keeps its
/// allocator (and so the device) alive; a block frees itself on drop, a part keeps its block.
pub struct GpuBuffer {
    buffer: wgpu::Buffer,
    addr: u64,
    /// Where it starts in `buffer`.
    offset: u64,
    len: usize,
    size: usize,
    alloc: Arc<Allocator>,
    /// The block a part lies in; `None` for a block.
    block: Option<Arc<GpuBuffer>>,
}

impl GpuBuffer {
    /// `len` bytes, zeroed (fresh wgpu buffers are; a reused arena block is cleared in command
    /// order, after whatever its last owner recorded).
    pub(crate) fn new(alloc: &Arc<Allocator>, len: usize) -> Result<Self> {
        let block = alloc.alloc(len)?;
        let buffer = match alloc.raw().buffer(block.addr, block.size) {
            Ok(b) => b,
            Err(e) => {
                // SAFETY: the block just handed out, given back once, unused.
                unsafe { alloc.free(block.addr, block.size) };
                return Err(e);
            }
        };
        let buf =
            GpuBuffer { buffer, addr: block.addr, offset: 0, len, size: block.size, alloc: alloc.clone(), block: None };
        if block.reused {
            buf.clear();
        }
        Ok(buf)
    }

    /// `len` bytes of `block` from `from` (4-byte aligned, as copies need), as a buffer of their
    /// own that keeps the block.
    pub(crate) fn part(block: &Arc<GpuBuffer>, from: usize, len: usize) -> Self {
        debug_assert!(from.is_multiple_of(4) && from + len <= block.len);
        GpuBuffer {
            buffer: block.buffer.clone(),
            addr: block.addr + from as u64,
            offset: block.offset + from as u64,
            len,
            size: len.next_multiple_of(4),
            alloc: block.alloc.clone(),
            block: Some(block.clone()),
        }
    }

    /// The block this is a part of, and where in it this starts.
    pub(crate) fn block(&self) -> Option<(&Arc<GpuBuffer>, usize)> {
        self.block.as_ref().map(|b| (b, (self.offset - b.offset) as usize))
    }

    pub fn addr(&self) -> usize {
        self.addr as usize
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole block or part, as shaders bind it.
    pub(crate) fn range(&self) -> Range<'_> {
        Range { buffer: &self.buffer, offset: self.offset, size: self.size as u64 }
    }

    /// `len` bytes from `from` within this block or part (4-byte aligned), as copies address it.
    pub(crate) fn sub(&self, from: usize, len: usize) -> Range<'_> {
        Range { buffer: &self.buffer, offset: self.offset + from as u64, size: len as u64 }
    }

    pub(crate) fn clear(&self) {
        let (buffer, offset, size) = (&self.buffer, self.offset, self.size as u64);
        self.alloc.raw().gpu.record(|e| e.clear_buffer(buffer, offset, Some(size)));
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if self.block.is_none() {
            // SAFETY: the block `new` got from this allocator, given back once (its parts keep
            // it until they go); commands already recorded over it run before any later owner's
            // (one encoder, in order).
            unsafe { self.alloc.free(self.addr, self.size) };
        }
    }
}
