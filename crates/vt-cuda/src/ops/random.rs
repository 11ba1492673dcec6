//! Random tensor contents made on the device (dummy weights: 35B parameters in about a second,
//! not minutes of host generation and upload).

use cudarc::driver::PushKernelArg;
use vt_core::{DType, Error, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::launch::{grid1, launched};

/// `Backend::random` on the device: kernels/random.cu writes the bytes vt_core::random_bytes does.
pub(crate) fn random(b: &CudaBackend, dtype: DType, shape: &[usize], seed: u64, scale: f32) -> Result<CudaTensor> {
    let numel: usize = shape.iter().product();
    let (kind, n): (i32, usize) = match dtype {
        DType::F32 => (0, numel),
        DType::BF16 => (1, numel),
        DType::F8E4M3 => (2, numel),
        DType::U8 | DType::F4x2 => (3, dtype.bytes_for(numel).unwrap_or(0)),
        DType::F16 | DType::I64 => return Err(Error::input(format!("random values of {dtype} are not supported"))),
    };
    let t = b.empty(dtype, shape)?;
    let (p, ni, key) = (t.buffer().ptr(), n as i64, vt_core::random::mix(seed));
    let mut l = b.stream().launch_builder(&b.k().fill_random);
    l.arg(&p).arg(&kind).arg(&ni).arg(&key).arg(&scale);
    // SAFETY: fill_random(void* out, int kind, long long n, u64 key, float scale): one thread per
    // element (per byte for kind 3); `t` holds n elements of that size.
    launched(unsafe { l.launch(grid1(n)) }, "fill_random")?;
    Ok(t)
}
