//! Linear layers: the decode GEMV kernels for a few tokens (gemv.rs), NVFP4 on tensor cores for
//! more (w4a16.rs), bf16 through cuBLASLt, and a simple kernel (kernels/linear.cu) for the rest.

pub(crate) mod gemv;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{DType, Linear, Result, Weight};

use super::with_last;
use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{act, i32_of, launched, MAX_SHARED};
use crate::weight::WeightDesc;

pub(crate) fn linear(b: &CudaBackend, x: &CudaTensor, w: &Linear<CudaBackend>) -> Result<CudaTensor> {
    let (n, k) = vt_core::backend::check::linear(b, x, w)?;
    let (px, t) = (act(x, "linear")?, x.rows());
    let out = b.empty(DType::BF16, &with_last(x.shape(), n))?;
    let py = out.buffer().ptr();
    if gemv::fits(b, t, &[&w.weight]) {
        gemv::gemv(b, px, t, &[(&w.weight, py)])?;
        return Ok(out);
    }
    if crate::w4a16::fits(t, &w.weight) {
        crate::w4a16::linear(b, px, t, w, py)?;
        return Ok(out);
    }
    if let Weight::Dense(wt) = &w.weight {
        // cuBLASLt's bf16 kernels want 16-byte aligned rows; odd shapes (router-sized outputs,
        // per-head gates) take the simple kernel.
        if wt.dtype() == DType::BF16 && n % 8 == 0 && k % 8 == 0 {
            // SAFETY: x holds t * k, the weight n * k and out t * n bf16 values, all alive
            // until the stream runs the GEMM (buffers free in stream order).
            unsafe { b.gemm().bf16_xwt(b.stream(), px, wt.buffer().ptr(), py, t, n, k)? };
            return Ok(out);
        }
    }
    let desc = WeightDesc::of(&w.weight, "linear")?;
    check(k * 4 <= MAX_SHARED && n.div_ceil(8) <= 65535, "linear", || {
        format!("weight [{n}, {k}] exceeds the simple kernel's limits")
    })?;
    let ni = i32_of(n, "linear outputs")?;
    let mut l = b.stream().launch_builder(&b.k().linear_rows);
    l.arg(&py).arg(&px).arg(&desc).arg(&ni);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, n.div_ceil(8) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (k * 4) as u32,
    };
    // SAFETY: linear_rows(bf16* y, const bf16* x, WeightDesc w, int n): grid (t, n/8), k f32
    // of shared memory; desc describes the live [n, k] weight (validated at load).
    launched(unsafe { l.launch(cfg) }, "linear_rows")?;
    Ok(out)
}

pub(crate) fn linear_many(b: &CudaBackend, x: &CudaTensor, ws: &[&Linear<CudaBackend>]) -> Result<Vec<CudaTensor>> {
    // One GEMV launch per group of weights the kernels take together (one format, x's width); an
    // NVFP4 mixer's bf16 gate rows go in a launch of their own instead of one each.
    let (t, k) = (x.rows(), x.last_dim());
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut alone = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        if w.weight.dims().1 != k || !gemv::fits(b, t, &[&w.weight]) {
            alone.push(i);
            continue;
        }
        let joins = |g: &Vec<usize>| {
            let mut ours: Vec<_> = g.iter().map(|&j| &ws[j].weight).collect();
            ours.push(&w.weight);
            gemv::fits(b, t, &ours)
        };
        match groups.iter_mut().find(|g| joins(g)) {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    let mut outs: Vec<Option<CudaTensor>> = ws.iter().map(|_| None).collect();
    let px = act(x, "linear")?;
    for g in &groups {
        let ys = g
            .iter()
            .map(|&i| b.empty(DType::BF16, &with_last(x.shape(), ws[i].weight.dims().0)))
            .collect::<Result<Vec<_>>>()?;
        let parts: Vec<_> = g.iter().zip(&ys).map(|(&i, y)| (&ws[i].weight, y.buffer().ptr())).collect();
        gemv::gemv(b, px, t, &parts)?;
        for (&i, y) in g.iter().zip(ys) {
            outs[i] = Some(y);
        }
    }
    for i in alone {
        outs[i] = Some(linear(b, x, ws[i])?);
    }
    Ok(outs.into_iter().flatten().collect())
}
