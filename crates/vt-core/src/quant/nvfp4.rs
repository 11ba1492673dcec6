//! NVFP4: e2m1 codes, one fp8 e4m3 scale per 16 inputs, one f32 multiplier per tensor.

use super::{bytes, Quantized};
use crate::backend::Device;
use crate::tensor::Tensor;
use crate::{DType, Error, Result};

pub const NVFP4_GROUP: usize = 16;

/// NVFP4 weight `[n, k]`: `W[i, j] = e2m1(codes[i, j]) * f8(scales[i, j / 16]) * global_scale`.
/// Made by `Nvfp4::new`, which gives the backend its say on how the parts are stored.
pub struct Nvfp4<B: Device> {
    /// `F4x2`, logical shape `[n, k]`. The checkpoint's bytes are `[n, k / 2]`, even element in
    /// the low nibble; a backend may keep them in its kernels' layout (`Device::nvfp4_parts`).
    pub codes: Tensor<B>,
    /// `F8E4M3`, logical shape `[n, k / 16]`, laid out as the backend keeps `codes`.
    pub scales: Tensor<B>,
    /// Per-tensor multiplier (compressed-tensors' global scale is its reciprocal).
    pub global_scale: f32,
}

impl<B: Device> Nvfp4<B> {
    /// The weight whose parts `codes` and `scales` hold the checkpoint's bytes on `backend`,
    /// checked (`name` is for the error), then stored as the backend keeps NVFP4.
    pub fn new(backend: &B, name: &str, codes: Tensor<B>, scales: Tensor<B>, global_scale: f32) -> Result<Self> {
        let q = Nvfp4 { codes, scales, global_scale };
        q.validate(name)?;
        let (codes, scales) = backend.nvfp4_parts(q.codes, q.scales)?;
        Ok(Nvfp4 { codes, scales, global_scale })
    }
}

impl<B: Device> Quantized<B> for Nvfp4<B> {
    fn dims(&self) -> (usize, usize) {
        (self.codes.shape()[0], self.codes.shape()[1])
    }

    fn values(&self) -> &Tensor<B> {
        &self.codes
    }

    fn resident_bytes(&self) -> usize {
        bytes(&self.codes) + bytes(&self.scales) + std::mem::size_of::<f32>()
    }

    fn validate(&self, name: &str) -> Result<()> {
        let (n, k) = self.dims();
        if k % NVFP4_GROUP != 0 {
            return Err(Error::tensor(name, format!("NVFP4 input size {k} is not a multiple of {NVFP4_GROUP}")));
        }
        if self.scales.shape() != [n, k / NVFP4_GROUP] || self.scales.dtype() != DType::F8E4M3 {
            return Err(Error::tensor(
                name,
                format!(
                    "NVFP4 scales must be F8_E4M3 [{n}, {}], found {} {:?}",
                    k / NVFP4_GROUP,
                    self.scales.dtype(),
                    self.scales.shape()
                ),
            ));
        }
        if !self.global_scale.is_finite() {
            return Err(Error::tensor(name, format!("NVFP4 global scale {} is not finite", self.global_scale)));
        }
        Ok(())
    }
}
