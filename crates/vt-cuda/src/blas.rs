//! bf16 GEMMs through cuBLASLt: `y [t, n] = x [t, k] · W [n, k]ᵀ`, f32 accumulation, bf16 out.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaContext, CudaStream};
use vt_core::{Error, Result};

use crate::alloc::{Allocator, CudaBuffer};

const WORKSPACE: usize = 32 << 20;
/// `cublasOperation_t`: CUBLAS_OP_N, CUBLAS_OP_T.
const OP_N: i32 = 0;
const OP_T: i32 = 1;

fn blas_err(what: &str, e: lt::CublasError) -> Error {
    Error::backend("cuda", format!("cuBLASLt {what}: {e:?}"))
}

/// One cuBLASLt handle and its workspace (from the backend's allocator, so it is accounted).
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaBuffer,
    /// The context the handle was made in, bound where it is destroyed.
    ctx: Arc<CudaContext>,
}

// SAFETY: the handle is only used on the owning backend's stream; cuBLASLt handles may be used
// from any thread as long as calls on one handle are not concurrent for the same stream work,
// and every call below goes through `&self` of a backend whose stream serialises them.
unsafe impl Send for Gemm {}
// SAFETY: as above.
unsafe impl Sync for Gemm {}

impl Gemm {
    pub fn new(alloc: &Arc<Allocator>) -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| blas_err("create handle", e))?;
        let ctx = alloc.raw().stream().context().clone();
        Ok(Gemm { handle, workspace: CudaBuffer::new(alloc, WORKSPACE)?, ctx })
    }

    /// `y = x Wᵀ` for bf16 `x` `[t, k]`, `w` `[n, k]`, `y` `[t, n]` (device addresses).
    ///
    /// # Safety
    /// The three addresses must hold those many bf16 values and stay alive until the stream
    /// has run the GEMM.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bf16_xwt(
        &self,
        stream: &CudaStream,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.xwt(stream, x, w, y, t, n, k, sys::cudaDataType_t::CUDA_R_16BF, 1.0) }
    }

    /// As `bf16_xwt` with `y` of type `out` (bf16, or f32 where the next step wants full
    /// precision, as router logits do), times `alpha` (applied to the f32 sums before `y`'s
    /// rounding: an NVFP4 weight's per-tensor multiplier).
    ///
    /// # Safety
    /// As `bf16_xwt`, with `y` holding `t * n` values of `out`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn xwt(
        &self,
        stream: &CudaStream,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        out: sys::cudaDataType_t,
        alpha: f32,
    ) -> Result<()> {
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        // Column-major view: Yᵀ [n, t] = W [k, n]ᵀ · Xᵀ [k, t].
        let a = Layout::new(bf, k, n, k)?;
        let b = Layout::new(bf, k, t, k)?;
        let c = Layout::new(out, n, t, n)?;
        let desc = Desc(
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
                .map_err(|e| blas_err("matmul desc", e))?,
        );
        for (attr, op) in [
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, OP_T),
            (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, OP_N),
        ] {
            // SAFETY: `desc` is live; the attribute is an i32 `cublasOperation_t`.
            unsafe { lt::set_matmul_desc_attribute(desc.0, attr, (&op as *const i32).cast(), 4) }
                .map_err(|e| blas_err("transpose attribute", e))?;
        }
        let pref = Pref(lt::create_matmul_pref().map_err(|e| blas_err("preference", e))?);
        let ws = self.workspace.len();
        // SAFETY: `pref` is live; the attribute is a usize byte count.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
        }
        .map_err(|e| blas_err("workspace attribute", e))?;
        // SAFETY: every descriptor is live for the call.
        let heur = unsafe { lt::get_matmul_algo_heuristic(self.handle, desc.0, a.0, b.0, c.0, c.0, pref.0) }
            .map_err(|e| blas_err(&format!("no algorithm for [{t}, {k}] x [{n}, {k}]ᵀ"), e))?;
        let beta = 0.0f32;
        // SAFETY: the caller guarantees the operand sizes; the layouts above describe exactly them,
        // the workspace is ours and the stream is the backend's.
        unsafe {
            lt::matmul(
                self.handle,
                desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                a.0,
                x as *const c_void,
                b.0,
                y as *const c_void,
                c.0,
                y as *mut c_void,
                c.0,
                &heur.algo,
                self.workspace.ptr() as *mut c_void,
                ws,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| blas_err("matmul", e))
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new`, is given up once and not used after.
        unsafe { crate::open_captures::destroy_handle(self.handle, self.ctx.clone()) };
    }
}

struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(dt: sys::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Self> {
        lt::create_matrix_layout(dt, rows as u64, cols as u64, ld as i64)
            .map(Layout)
            .map_err(|e| blas_err("matrix layout", e))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}
