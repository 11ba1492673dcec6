//! A backend tensor: one owned, contiguous, row-major buffer with its dtype and shape.

use crate::backend::Device;
use crate::{DType, Error, Result};

pub struct Tensor<B: Device> {
    buf: B::Buffer,
    dtype: DType,
    shape: Vec<usize>,
}

impl<B: Device> Tensor<B> {
    /// Wraps a buffer a backend produced. Backends call this; the byte length is theirs to get right.
    pub fn from_parts(buf: B::Buffer, dtype: DType, shape: Vec<usize>) -> Self {
        Tensor { buf, dtype, shape }
    }

    pub fn buffer(&self) -> &B::Buffer {
        &self.buf
    }

    pub fn buffer_mut(&mut self) -> &mut B::Buffer {
        &mut self.buf
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of the last dimension (1 for a scalar).
    pub fn last_dim(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows when the tensor is viewed as `[rows, last_dim]`.
    pub fn rows(&self) -> usize {
        self.numel() / self.last_dim().max(1)
    }

    /// `(tokens, heads, dim)` of a 3-D activation; the error names the op and the backend.
    pub fn dims3(&self, backend: &'static str, op: &str) -> Result<(usize, usize, usize)> {
        match *self.shape() {
            [a, b, c] => Ok((a, b, c)),
            _ => Err(Error::backend(
                backend,
                format!("{op}: expected a [tokens, heads, dim] tensor, found {:?}", self.shape()),
            )),
        }
    }

    /// Same buffer, new shape with the same element count.
    pub fn reshape(self, shape: &[usize]) -> Result<Self> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::input(format!("cannot reshape {:?} to {:?}", self.shape, shape)));
        }
        Ok(Tensor { buf: self.buf, dtype: self.dtype, shape: shape.to_vec() })
    }
}

impl<B: Device> std::fmt::Debug for Tensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor<{}>({}, {:?})", std::any::type_name::<B>(), self.dtype, self.shape)
    }
}
