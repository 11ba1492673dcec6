//! The device a `CudaBackend` runs on and its memory: one CUDA context, one stream, an accounted
//! allocator, the compiled kernels and a cuBLASLt handle, shared by the backend's clones; and the
//! transfers in and out of device memory that every op uses.
//!
//! Every op queues work on the stream and returns at once; only reads back to the host wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream};
use vt_core::backend::Device;
use vt_core::{DType, Result, Tensor};

use crate::alloc::{AllocMode, Allocator, CudaBuffer};
use crate::blas::Gemm;
use crate::capture::Recording;
use crate::error::{check, driver_err, err};
use crate::kernels::Kernels;

/// Source of instance ids; ids only distinguish instances, nothing is keyed by them globally.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

struct Inner {
    id: u64,
    kernels: Arc<Kernels>,
    gemm: Arc<Gemm>,
    alloc: Arc<Allocator>,
    /// Set on a recorder (record.rs): its ops are captured, not run.
    recording: Option<Recording>,
}

/// A tensor in this backend's memory.
pub(crate) type CudaTensor = Tensor<CudaBackend>;

/// The CUDA backend. Clones share one device context, stream, allocator and kernels.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl CudaBackend {
    /// A backend on device 0 with the system allocator.
    pub fn new() -> Result<Self> {
        Self::with_mode(AllocMode::System)
    }

    /// A backend on device 0: its own stream, allocator (in `mode`) and freshly compiled kernels.
    pub fn with_mode(mode: AllocMode) -> Result<Self> {
        Self::on_device(0, mode)
    }

    /// A backend on device `ordinal` (a rank of a tensor-parallel model), as `with_mode`.
    pub fn on_device(ordinal: usize, mode: AllocMode) -> Result<Self> {
        let count = Self::device_count()?;
        check(ordinal < count, "opening a device", || format!("device {ordinal} asked for, {count} found"))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err(&format!("opening CUDA device {ordinal}"), e))?;
        // SAFETY: cudarc's event tracking orders its own `CudaSlice`s across streams; vt makes
        // none (its buffers are ordered on the backend's stream by its allocator). Left on, it
        // makes this context's first `new_stream` synchronise the device's whole (primary)
        // context: that waits on every other backend's work in the process, and fails while
        // another backend has a step's capture open (tests/recorded.rs).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| driver_err("creating a stream", e))?;
        let alloc = Arc::new(crate::alloc::new_allocator(mode, stream));
        let kernels = Kernels::load(&ctx)?;
        let gemm = Gemm::new(&alloc)?;
        let id = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
        let inner = Inner { id, kernels: Arc::new(kernels), gemm: Arc::new(gemm), alloc, recording: None };
        Ok(CudaBackend { inner: Arc::new(inner) })
    }

    /// A backend on this one's device, stream and memory (a clone's, sharing its weights' derived
    /// state) whose kernels take the numbers of limits.rs that `defines` names with its values:
    /// for benchmarks that compare kernel shapes in one process (decode_bench's `nv4` case). Only
    /// the kernel files that use one of the names are compiled again.
    pub fn with_kernel_defines(&self, defines: &[(&str, i64)]) -> Result<CudaBackend> {
        check(self.recording().is_none(), "with_kernel_defines", || "a recorder's kernels are its backend's".into())?;
        let kernels = self.inner.kernels.with_defines(self.stream().context(), defines)?;
        let inner = Inner {
            id: self.inner.id,
            kernels: Arc::new(kernels),
            gemm: self.inner.gemm.clone(),
            alloc: self.inner.alloc.clone(),
            recording: None,
        };
        Ok(CudaBackend { inner: Arc::new(inner) })
    }

    /// How many CUDA devices the driver sees.
    pub fn device_count() -> Result<usize> {
        CudaContext::device_count().map(|n| n.max(0) as usize).map_err(|e| driver_err("cuDeviceGetCount", e))
    }

    /// The device this backend runs on.
    pub fn ordinal(&self) -> usize {
        self.stream().context().ordinal()
    }

    /// The recording a recorder holds.
    pub(crate) fn recording(&self) -> Option<&Recording> {
        self.inner.recording.as_ref()
    }

    pub fn alloc_mode(&self) -> AllocMode {
        self.inner.alloc.mode()
    }

    pub(crate) fn k(&self) -> &Kernels {
        &self.inner.kernels
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.inner.alloc.raw().stream()
    }

    pub(crate) fn alloc(&self) -> &Arc<Allocator> {
        &self.inner.alloc
    }

    pub(crate) fn gemm(&self) -> &Gemm {
        &self.inner.gemm
    }

    /// Waits for every op queued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream().synchronize().map_err(|e| driver_err("synchronize", e))
    }

    /// `(free, total)` device bytes as the driver reports them (`cuMemGetInfo`).
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        self.stream().context().mem_get_info().map_err(|e| driver_err("cuMemGetInfo", e))
    }

    pub(crate) fn buffer(&self, len: usize) -> Result<CudaBuffer> {
        CudaBuffer::new(&self.inner.alloc, len)
    }

    /// An uninitialised tensor the next kernel fills.
    pub(crate) fn empty(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self>> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n).ok_or_else(|| err(format!("{dtype} {shape:?} has no byte size")))?;
        Ok(Tensor::from_parts(self.buffer(bytes)?, dtype, shape.to_vec()))
    }

    pub(crate) fn zeroed(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self>> {
        let mut t = self.empty(dtype, shape)?;
        self.zero(&mut t)?;
        Ok(t)
    }

    pub(crate) fn copy_in<T>(&self, dst: &CudaBuffer, src: &[T]) -> Result<()> {
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: `dst` holds `size_of_val(src)` bytes (callers size it so); a pageable source is
        // staged before the call returns, so `src` may go away afterwards.
        unsafe { result::memcpy_htod_async(dst.ptr(), src, self.stream().cu_stream()) }
            .map_err(|e| driver_err("host-to-device copy", e))
    }

    /// Fills `dst` from the start of `src` once the stream has run everything queued before, and
    /// waits for it (a recorder runs nothing, so it has nothing to read back).
    pub(crate) fn copy_out<T>(&self, dst: &mut [T], src: &CudaBuffer, op: &str) -> Result<()> {
        check(self.recording().is_none(), op, || "a recorder runs nothing to read back".into())?;
        check(std::mem::size_of_val(dst) <= src.len(), op, || {
            format!("{} bytes from a buffer of {}", std::mem::size_of_val(dst), src.len())
        })?;
        self.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: `src` holds at least `size_of_val(dst)` bytes (checked); we wait for the copy
        // below, so `dst` outlives it.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr(), self.stream().cu_stream()) }
            .map_err(|e| driver_err("device-to-host copy", e))?;
        self.synchronize()
    }

    /// A small host array (ids, tables) in device memory.
    pub(crate) fn upload_slice<T>(&self, src: &[T]) -> Result<CudaBuffer> {
        let buf = self.buffer(std::mem::size_of_val(src))?;
        self.copy_in(&buf, src)?;
        Ok(buf)
    }

    /// This backend's instance id (its recorders share it).
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// A recorder of this backend: its ops go to `recording`'s capture stream, its memory to an
    /// arena of this backend's blocks.
    pub(crate) fn recorder_of(&self, recording: Recording) -> CudaBackend {
        let alloc = Arc::new(crate::alloc::for_recording(self.alloc(), recording.stream().clone()));
        let inner = Inner {
            id: self.inner.id,
            kernels: self.inner.kernels.clone(),
            gemm: self.inner.gemm.clone(),
            alloc,
            recording: Some(recording),
        };
        CudaBackend { inner: Arc::new(inner) }
    }
}
