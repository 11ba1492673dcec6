//! The CPU side of each quantized format: how one weight row is dotted with token vectors, and
//! how two weights of the format become one row-interleaved matrix (an MoE expert's gate and up).
//! `RowSource` (rows.rs) registers each format.

pub mod fp8;
pub mod nvfp4;

use std::sync::Arc;

use vt_core::Result;

use crate::alloc::{Allocator, CpuBuffer};

/// Interleaves the rows of `a` and `b` (each `rows` rows of `row_bytes`) into a new buffer.
pub fn interleave(alloc: &Arc<Allocator>, a: &[u8], b: &[u8], row_bytes: usize) -> Result<CpuBuffer> {
    let mut buf = CpuBuffer::new(alloc, a.len() + b.len())?;
    for (i, (ra, rb)) in a.chunks_exact(row_bytes).zip(b.chunks_exact(row_bytes)).enumerate() {
        let dst = &mut buf.bytes_mut()[2 * i * row_bytes..(2 * i + 2) * row_bytes];
        dst[..row_bytes].copy_from_slice(ra);
        dst[row_bytes..].copy_from_slice(rb);
    }
    Ok(buf)
}
