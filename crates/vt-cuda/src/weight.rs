//! How kernels see a weight: `WeightDesc`, the `#[repr(C)]` twin of `struct WeightDesc` in
//! kernels/common.cuh, passed by value or stored in device tables.

use cudarc::driver::DeviceRepr;
use vt_core::{DType, Error, Result, Tensor, Weight};

use crate::device::CudaBackend;

pub(crate) use crate::limits::{DT_BF16, DT_F16, DT_F32, DT_FP8, DT_NVFP4};

/// The kernels' code for a float tensor's dtype.
pub fn float_code(t: &Tensor<CudaBackend>, op: &str) -> Result<i32> {
    match t.dtype() {
        DType::F32 => Ok(DT_F32),
        DType::BF16 => Ok(DT_BF16),
        DType::F16 => Ok(DT_F16),
        other => Err(Error::backend("cuda", format!("{op}: expected an f32/bf16/f16 tensor, found {other}"))),
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct WeightDesc {
    pub data: u64,
    /// Block scales: NVFP4's fp8 per 16 inputs, FP8's f32 per block (0 for dense weights).
    pub scales: u64,
    /// NVFP4 per-tensor multiplier in `[0]` (both slots hold it). FP8 has no multiplier: the slots hold the bits of its block, rows and
    /// inputs per scale (the C struct's `int block[2]`, a union with `global`), so the struct
    /// stays 32 bytes.
    pub global: [f32; 2],
    pub kind: i32,
    /// Inputs per row.
    pub k: i32,
}

// SAFETY: `WeightDesc` is `#[repr(C)]` plain data laid out exactly as the CUDA struct
// (u64, u64, union { float[2]; int[2] }, int, int: 32 bytes, 8-byte aligned, no padding).
unsafe impl DeviceRepr for WeightDesc {}

impl WeightDesc {
    /// How the kernels see `w`; each quantized format is registered here (its kind, and its
    /// element decode `w_at` in kernels/common.cuh, which every general kernel reads through).
    pub fn of(w: &Weight<CudaBackend>, op: &str) -> Result<Self> {
        let int =
            |v: usize, what: &str| i32::try_from(v).map_err(|_| Error::backend("cuda", format!("{op}: {v} {what}")));
        let k = int(w.dims().1, "inputs per row")?;
        Ok(match w {
            Weight::Dense(t) => {
                WeightDesc { data: t.buffer().ptr(), scales: 0, global: [1.0; 2], kind: float_code(t, op)?, k }
            }
            // `data` and `scales` in the tiled layout this backend keeps NVFP4 in (nvfp4.rs).
            Weight::Nvfp4(q) => WeightDesc {
                data: q.codes.buffer().ptr(),
                scales: q.scales.buffer().ptr(),
                global: [q.global_scale; 2],
                kind: DT_NVFP4,
                k,
            },
            Weight::Fp8(q) => WeightDesc {
                data: q.values.buffer().ptr(),
                scales: q.scales.buffer().ptr(),
                global: [
                    f32::from_bits(int(q.block[0], "rows per scale")? as u32),
                    f32::from_bits(int(q.block[1], "inputs per scale")? as u32),
                ],
                kind: DT_FP8,
                k,
            },
        })
    }
}

/// The C struct's layout is this one's (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    crate::kernels::c_layout!(WeightDesc { data, scales, global, kind, k })
}
