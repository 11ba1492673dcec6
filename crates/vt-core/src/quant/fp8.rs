//! FP8 with block scales, as transformers' FineGrainedFP8 checkpoints store it (Qwen's and
//! DeepSeek's `quant_method: fp8`): e4m3 values and one f32 scale per `[bn, bk]` block of the
//! matrix; a dimension that is not a multiple of its block size ends in a partial block.

use super::{bytes, Quantized};
use crate::backend::Device;
use crate::tensor::Tensor;
use crate::{DType, Error, Result};

/// FP8 weight `[n, k]`: `W[i, j] = e4m3(values[i, j]) * scales[i / bn, j / bk]`.
pub struct Fp8Block<B: Device> {
    /// `F8E4M3`, shape `[n, k]`.
    pub values: Tensor<B>,
    /// `F32`, shape `[ceil(n / bn), ceil(k / bk)]` (checkpoints' `weight_scale_inv`).
    pub scales: Tensor<B>,
    /// `[bn, bk]`: rows and inputs per scale.
    pub block: [usize; 2],
}

impl<B: Device> Fp8Block<B> {
    /// The scales' shape for a `[n, k]` matrix in blocks of `block`.
    pub fn scales_shape(n: usize, k: usize, block: [usize; 2]) -> [usize; 2] {
        [n.div_ceil(block[0]), k.div_ceil(block[1])]
    }
}

impl<B: Device> Quantized<B> for Fp8Block<B> {
    fn dims(&self) -> (usize, usize) {
        (self.values.shape()[0], self.values.shape()[1])
    }

    fn values(&self) -> &Tensor<B> {
        &self.values
    }

    fn resident_bytes(&self) -> usize {
        bytes(&self.values) + bytes(&self.scales)
    }

    fn validate(&self, name: &str) -> Result<()> {
        let shape = self.values.shape();
        if shape.len() != 2 || self.values.dtype() != DType::F8E4M3 {
            return Err(Error::tensor(
                name,
                format!("FP8 values must be a 2-D F8_E4M3 matrix, found {} {shape:?}", self.values.dtype()),
            ));
        }
        if self.block.contains(&0) {
            return Err(Error::tensor(name, format!("FP8 block size {:?} has a zero side", self.block)));
        }
        let want = Self::scales_shape(shape[0], shape[1], self.block);
        if self.scales.shape() != want || self.scales.dtype() != DType::F32 {
            return Err(Error::tensor(
                name,
                format!(
                    "FP8 scales of blocks {:?} must be F32 {want:?}, found {} {:?}",
                    self.block,
                    self.scales.dtype(),
                    self.scales.shape()
                ),
            ));
        }
        Ok(())
    }
}
