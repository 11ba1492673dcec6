//! How kernels are launched: argument helpers every op uses (`act`, `i32_of`, `grid1`, `launched`),
//! and `Overlapped`, a launch that overlaps the previous kernel's end. Kernel arguments are device
//! addresses (`u64`), `i32`/`i64` counts and `f32` scalars, in the order of each kernel's C
//! signature (quoted at every launch).
//!
//! Programmatic dependent launch (Hopper): `Overlapped` launches a kernel that may start while the
//! previous kernel on the stream is still finishing, so a decode kernel's weight loads (which no
//! kernel writes) overlap its predecessor's tail and launch latency. Such a kernel must execute
//! `grid_dep_wait()` (kernels/common.cuh) before it reads anything an earlier kernel wrote or
//! writes anything an earlier kernel reads; every kernel launched here does. What they read before
//! the wait are weights, which kernels write only while a model loads (dummy weights, expert
//! tables) and never as the kernel right before one that reads them. One exception: a kernel
//! whose predecessor triggers it only after its own wait (`grid_dep_wait_then_trigger`) starts
//! after the kernel before that one has ended, and may read what that one wrote (through L2); the
//! MoE down kernels read the routing so.

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, DeviceRepr, DriverError, LaunchConfig};
use vt_core::{DType, Result, Tensor};

use crate::device::CudaBackend;
use crate::error::{check, driver_err, err};

/// Dynamic shared memory a kernel may use without opting in (48 KiB).
pub(crate) const MAX_SHARED: usize = 48 << 10;

/// A cudarc launch's result, its error naming the kernel.
pub(crate) fn launched<T>(r: std::result::Result<T, DriverError>, kernel: &str) -> Result<()> {
    r.map(|_| ()).map_err(|e| driver_err(&format!("launching {kernel}"), e))
}

/// `n` threads in blocks of 256.
pub(crate) fn grid1(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// `v` as a kernel's 32-bit count, or an error naming `what`.
pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| err(format!("{what} = {v} does not fit the kernels' 32-bit counts")))
}

/// Device address of a bf16 activation, or an error naming the op.
pub(crate) fn act(t: &Tensor<CudaBackend>, op: &str) -> Result<u64> {
    check(t.dtype() == DType::BF16, op, || format!("expected a BF16 activation, found {} {:?}", t.dtype(), t.shape()))?;
    Ok(t.buffer().ptr())
}

/// A kernel's arguments, collected as cudarc's launch builder does, for `cuLaunchKernelEx`.
pub(crate) struct Overlapped<'a> {
    b: &'a CudaBackend,
    f: &'a CudaFunction,
    args: Vec<*mut c_void>,
    cluster: Option<(u32, u32, u32)>,
}

impl<'a> Overlapped<'a> {
    pub(crate) fn new(b: &'a CudaBackend, f: &'a CudaFunction) -> Self {
        Overlapped { b, f, args: Vec::new(), cluster: None }
    }

    /// Launches the blocks in thread block clusters of these dimensions (each dividing the grid's).
    pub(crate) fn cluster(&mut self, dims: (u32, u32, u32)) -> &mut Self {
        self.cluster = Some(dims);
        self
    }

    /// The next argument, in the order of the kernel's C signature; it must outlive the launch.
    pub(crate) fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(v as *const T as *mut c_void);
        self
    }

    /// Queues the kernel on the backend's stream.
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the arguments match the kernel's signature and every
    /// address they carry is valid for what the kernel does with it; in addition the kernel waits
    /// (`grid_dep_wait`) before it touches memory an earlier kernel writes or reads (except what
    /// it reads of kernels that ended before its predecessor triggered it: module docs).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig, kernel: &str) -> Result<()> {
        let stream = self.b.stream();
        stream.context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        // SAFETY: all-zero is a valid launch attribute (a union of plain integers); the ids and
        // values set below ask for programmatic stream serialisation and, where asked, clusters.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        attrs[0].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[0].value.programmaticStreamSerializationAllowed = 1;
        if let Some((x, y, z)) = self.cluster {
            attrs[1].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[1].value.clusterDim.x = x;
            attrs[1].value.clusterDim.y = y;
            attrs[1].value.clusterDim.z = z;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: 1 + self.cluster.is_some() as u32,
        };
        // SAFETY: `config` and `attrs` live across the call; `args` points at one live value per
        // kernel parameter (the caller's contract), which the driver copies before returning.
        unsafe { sys::cuLaunchKernelEx(&config, self.f.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| driver_err(&format!("launching {kernel}"), e))
    }
}
