//! `Communicator` over NCCL: one process, one thread and one `CudaBackend` (context, stream) per
//! GPU, the communicators made together by `ncclCommInitAll` (docs/parallel.md says why). Every
//! collective is queued on its rank's backend stream, in order with that rank's kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::nccl::{result as nccl, sys};
use vt_core::{Communicator, DType, Result, Tensor};

use crate::device::CudaBackend;
use crate::error::{check, driver_err, err};

/// One rank's NCCL communicator, bound to the backend (device and stream) it was made for.
pub struct NcclComm {
    rank: usize,
    backend: CudaBackend,
    group: Arc<Group>,
}

/// Every rank's communicator: an abort aborts them all (a rank whose peer stopped would wait in
/// its collective kernels for ever), and the last rank dropped frees them.
struct Group {
    comms: Vec<sys::ncclComm_t>,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time per communicator:
// each rank's collectives come from that rank's one thread (`&self` methods it calls in turn), and
// `ncclCommAbort` is meant to be called from another thread to unblock ranks stuck in collectives.
unsafe impl Send for Group {}
// SAFETY: as for Send.
unsafe impl Sync for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Acquire) {
            return; // ncclCommAbort freed them
        }
        for &c in &self.comms {
            // SAFETY: a communicator `NcclComm::group` made, not aborted, freed once; its queued
            // collectives finish first (ncclCommDestroy waits). A failure has no one to report to.
            let _ = unsafe { nccl::comm_destroy(c) };
        }
    }
}

impl NcclComm {
    /// One communicator per backend, rank `i` on `backends[i]`; each backend on its own device.
    pub fn group(backends: &[CudaBackend]) -> Result<Vec<NcclComm>> {
        let ordinals: Vec<i32> = backends.iter().map(|b| b.ordinal() as i32).collect();
        let mut distinct = ordinals.clone();
        distinct.sort_unstable();
        distinct.dedup();
        check(!ordinals.is_empty() && distinct.len() == ordinals.len(), "nccl group", || {
            format!("needs one backend per distinct device, got devices {ordinals:?}")
        })?;
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `comms` has room for one communicator per device of `ordinals`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| err(format!("ncclCommInitAll over devices {ordinals:?}: {e:?}")))?;
        let group = Arc::new(Group { comms, aborted: AtomicBool::new(false) });
        let rank = |(rank, b): (usize, &CudaBackend)| NcclComm { rank, backend: b.clone(), group: group.clone() };
        Ok(backends.iter().enumerate().map(rank).collect())
    }

    fn comm(&self) -> sys::ncclComm_t {
        self.group.comms[self.rank]
    }

    /// The NCCL type of a tensor's elements, and its backend checked to be this rank's.
    fn prepare(&self, b: &CudaBackend, x: &Tensor<CudaBackend>, op: &str) -> Result<sys::ncclDataType_t> {
        check(!self.group.aborted.load(Ordering::Acquire), op, || "the rank group was aborted".into())?;
        check(b.ordinal() == self.backend.ordinal(), op, || {
            format!("rank {} is on device {}, the call on device {}", self.rank, self.backend.ordinal(), b.ordinal())
        })?;
        b.stream().context().bind_to_thread().map_err(|e| driver_err("bind context", e))?;
        match x.dtype() {
            DType::BF16 => Ok(sys::ncclDataType_t::ncclBfloat16),
            DType::F32 => Ok(sys::ncclDataType_t::ncclFloat32),
            d => Err(err(format!("{op}: {d} tensors are not exchanged"))),
        }
    }
}

impl Communicator<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.group.comms.len()
    }

    fn all_reduce_sum(&self, b: &CudaBackend, x: &Tensor<CudaBackend>) -> Result<Tensor<CudaBackend>> {
        let ty = self.prepare(b, x, "all_reduce_sum")?;
        let out = b.empty(x.dtype(), x.shape())?;
        // SAFETY: `x` and `out` hold `numel` elements of `ty` on this rank's device; the call is
        // queued on the backend's stream, after the kernels that wrote `x`.
        unsafe {
            nccl::all_reduce(
                x.buffer().ptr() as *const _,
                out.buffer().ptr() as *mut _,
                x.numel(),
                ty,
                sys::ncclRedOp_t::ncclSum,
                self.comm(),
                b.stream().cu_stream() as _,
            )
        }
        .map_err(|e| err(format!("ncclAllReduce of {:?}: {e:?}", x.shape())))?;
        Ok(out)
    }

    /// NCCL gathers equal counts end to end: each rank's `[rows, cols_r]` is padded to the widest
    /// rank's columns, gathered as `[ranks, rows, widest]`, then each rank's block is copied into
    /// its columns of the result (one 2-D copy per rank).
    fn all_gather_cols(&self, b: &CudaBackend, x: &Tensor<CudaBackend>) -> Result<Tensor<CudaBackend>> {
        let ty = self.prepare(b, x, "all_gather_cols")?;
        let (rows, cols) = (x.rows(), x.last_dim());
        let elem = x.dtype().bytes_for(1).unwrap_or(2);
        // Every rank's width: gathered first (a small all-gather of one u32 per rank).
        let widths = self.gather_widths(b, cols)?;
        let widest = widths.iter().copied().max().unwrap_or(0);
        let padded = b.zeroed(x.dtype(), &[rows, widest])?;
        self.copy_2d(b, x.buffer().ptr(), cols * elem, padded.buffer().ptr(), widest * elem, cols * elem, rows)?;
        let gathered = b.empty(x.dtype(), &[self.group.comms.len(), rows, widest])?;
        // SAFETY: `padded` holds rows * widest elements, `gathered` ranks times that; queued on
        // this rank's stream.
        unsafe {
            nccl::all_gather(
                padded.buffer().ptr() as *const _,
                gathered.buffer().ptr() as *mut _,
                rows * widest,
                ty,
                self.comm(),
                b.stream().cu_stream() as _,
            )
        }
        .map_err(|e| err(format!("ncclAllGather of {:?}: {e:?}", x.shape())))?;
        let total: usize = widths.iter().sum();
        let out = b.empty(x.dtype(), &[rows, total])?;
        let mut at = 0;
        for (r, &w) in widths.iter().enumerate() {
            let src = gathered.buffer().ptr() + (r * rows * widest * elem) as u64;
            self.copy_2d(b, src, widest * elem, out.buffer().ptr() + (at * elem) as u64, total * elem, w * elem, rows)?;
            at += w;
        }
        Ok(out)
    }

    fn abort(&self, _why: &str) {
        if !self.group.aborted.swap(true, Ordering::AcqRel) {
            for &c in &self.group.comms {
                // SAFETY: ncclCommAbort stops a communicator's uncompleted collectives and frees
                // it, from any thread; `aborted` (set first, once) keeps every later call and the
                // group's drop from using it again.
                let _ = unsafe { nccl::comm_abort(c) };
            }
        }
    }
}

impl NcclComm {
    /// Every rank's `cols`, in rank order.
    fn gather_widths(&self, b: &CudaBackend, cols: usize) -> Result<Vec<usize>> {
        let mine = b.upload_slice(&[cols as u32])?;
        let all = b.buffer(4 * self.group.comms.len())?;
        // SAFETY: `mine` holds one u32, `all` one per rank; queued on this rank's stream.
        unsafe {
            nccl::all_gather(
                mine.ptr() as *const _,
                all.ptr() as *mut _,
                1,
                sys::ncclDataType_t::ncclUint32,
                self.comm(),
                b.stream().cu_stream() as _,
            )
        }
        .map_err(|e| err(format!("ncclAllGather of widths: {e:?}")))?;
        let mut widths = vec![0u32; self.group.comms.len()];
        b.copy_out(&mut widths, &all, "all_gather_cols")?;
        Ok(widths.into_iter().map(|w| w as usize).collect())
    }

    /// `height` rows of `width` bytes from `src` (rows `src_pitch` apart) to `dst` (`dst_pitch`
    /// apart), on the stream.
    #[allow(clippy::too_many_arguments)]
    fn copy_2d(
        &self,
        b: &CudaBackend,
        src: u64,
        src_pitch: usize,
        dst: u64,
        dst_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        let copy = cu::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        // SAFETY: both regions are `height` rows of `width` bytes inside buffers the caller sized
        // (width <= both pitches); stream-ordered after the work that wrote `src`.
        unsafe { cu::cuMemcpy2DAsync_v2(&copy, b.stream().cu_stream()) }
            .result()
            .map_err(|e| driver_err("cuMemcpy2DAsync", e))
    }
}
