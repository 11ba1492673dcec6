//! vt-cuda: the CUDA backend on cudarc. Activations are bf16, accumulation f32, the gated delta
//! rule's state f32; bf16 GEMMs go through cuBLASLt, everything else through the kernels of
//! `kernels/*.cu` (NVRTC at backend start). Weights stay in their stored form: NVFP4 is computed
//! from the packed codes (W4A16), kept in the kernels' tiled layout (`nvfp4.rs`). Every buffer
//! comes from an accounted allocator with an optional placement-arena mode (`alloc.rs`).
//!
//! The crate is empty without the `cuda` feature, so the workspace builds with no CUDA at all;
//! with it, cudarc loads libcuda, libnvrtc and libcublasLt at run time.
//!
//! From the ground up: `error.rs`, `limits.rs` (the numbers shared with the kernels), `alloc.rs`,
//! `kernels.rs` (NVRTC), `open_captures.rs` (when cuBLASLt handles may be destroyed), `blas.rs`;
//! `device.rs` (the backend's device and memory); `launch.rs` (launch helpers); `nccl.rs` (the NCCL
//! communicator of tensor-parallel ranks); `kv.rs` (the KV block pool), `capture.rs` and
//! `record.rs` (recorded decode steps); `ops/` (each op family's launch code); `backend.rs` (the
//! Backend trait's layers, handing each method to its family).

#[cfg(feature = "cuda")]
mod alloc;
#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod capture;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod kv;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod limits;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nvfp4;
#[cfg(feature = "cuda")]
mod open_captures;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod record;
#[cfg(feature = "cuda")]
mod timing;
#[cfg(feature = "cuda")]
mod w4a16;
#[cfg(feature = "cuda")]
mod weight;

#[cfg(feature = "cuda")]
pub use alloc::{AllocMode, CudaBuffer};
#[cfg(feature = "cuda")]
pub use device::CudaBackend;
#[cfg(feature = "cuda")]
pub use kv::CudaKvPool;
#[cfg(feature = "cuda")]
pub use nccl::NcclComm;
#[cfg(feature = "cuda")]
pub use ops::moe::CudaExpertTable;
#[cfg(feature = "cuda")]
pub use record::CudaStepGraph;
#[cfg(feature = "cuda")]
pub use timing::DeviceTime;
