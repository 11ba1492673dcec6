//! Sampled picks on the device (kernels/sample.cu): a block per pick masks, adjusts, filters and
//! draws from its bf16 row, then `top_logprobs` (kernels/logprobs.cu) reads the picked ids where
//! they are for the logprobs. Up go each pick's parameters, its adjustments and its mask (31 KB
//! at a 248k vocabulary); back come only the ids, flags and logprobs, never the rows.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::backend::sample::check_picks;
use vt_core::backend::{LogitAdjust, Pick, SampleRow, Sampled};
use vt_core::{DType, Result};

use crate::device::{CudaBackend, CudaTensor};
use crate::error::check;
use crate::launch::{i32_of, launched};

/// Threads of a `sample_rows` block: a vocabulary-wide row is ~240 values a thread a pass.
const THREADS: usize = 1024;

/// One pick as the kernel takes it (kernels/sample.cu's `SampleArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SampleArgs {
    uniform: f64,
    row: i32,
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    adjust_at: i32,
    adjust_len: i32,
    mask_at: i32,
    pad: i32,
}

/// `Device::sample_rows`: other dtypes take vt-core's composed default.
pub(crate) fn sample_rows(
    b: &CudaBackend,
    x: &CudaTensor,
    picks: &[SampleRow<'_>],
    top_logprobs: Option<usize>,
) -> Result<Sampled> {
    let (rows, n) = (x.rows(), x.last_dim());
    check_picks(rows, n, picks)?;
    if x.dtype() != DType::BF16 || picks.is_empty() {
        return vt_core::backend::composed::sample_rows(b, x, picks, top_logprobs);
    }
    // Before the launch: a recorder would keep the kernels in its recording.
    check(b.recording().is_none(), "sample_rows", || "a recorder runs nothing to read back".into())?;
    let count = picks.len();
    let (mut args, mut adjust, mut masks) = (Vec::with_capacity(count), Vec::<LogitAdjust>::new(), Vec::new());
    for s in picks {
        let mask_at = match s.allowed {
            Some(bits) => {
                masks.extend_from_slice(bits);
                i32_of(masks.len() - bits.len(), "mask words")?
            }
            None => -1,
        };
        args.push(SampleArgs {
            uniform: s.uniform,
            row: i32_of(s.row, "row")?,
            temperature: s.temperature,
            // A cut at or past the width keeps the whole row.
            top_k: if s.top_k >= n { 0 } else { i32_of(s.top_k, "top_k")? },
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            adjust_at: i32_of(adjust.len(), "adjustments")?,
            adjust_len: i32_of(s.adjust.len(), "adjustments")?,
            mask_at,
            pad: 0,
        });
        adjust.extend_from_slice(s.adjust);
    }
    // The kernel reads none of an empty list; a buffer of one keeps every address valid.
    if adjust.is_empty() {
        adjust.push(LogitAdjust { token: u32::MAX, bias: 0.0, penalty: 0.0, repeated: 0 });
    }
    if masks.is_empty() {
        masks.push(0);
    }
    let (args_in, adjust_in, masks_in) = (b.upload_slice(&args)?, b.upload_slice(&adjust)?, b.upload_slice(&masks)?);
    let k = top_logprobs.map(|k| k.min(n));
    // One buffer, one read back: the ids, the rows' flags, then the logprobs (`logprobs::unpack`).
    let out = b.buffer(4 * (2 * count + k.map_or(0, |k| count * (2 * k + 1))))?;
    let scratch = b.buffer(count * n * 4)?;
    let (po, ps, px, pa, pj, pm) =
        (out.ptr(), scratch.ptr(), x.buffer().ptr(), args_in.ptr(), adjust_in.ptr(), masks_in.ptr());
    let (ni, ci) = (i32_of(n, "row width")?, i32_of(count, "picks")?);
    let mut l = b.stream().launch_builder(&b.k().sample_rows);
    l.arg(&po).arg(&ps).arg(&px).arg(&pa).arg(&pj).arg(&pm).arg(&ni).arg(&ci);
    let cfg = LaunchConfig { grid_dim: (count as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: sample_rows(unsigned* out, float* scratch, const bf16* x, const SampleArgs* args,
    // const LogitAdjust* adjust, const unsigned* allowed, int n, int picks): a block of THREADS
    // threads (whole warps) per pick; x holds rows * n bf16 values and every args[p].row is
    // below rows (check_picks); each pick's adjustments and mask (mask_words(n) words, checked)
    // lie inside adjust and allowed as built above; scratch holds picks * n floats, out at least
    // 2 * picks words.
    launched(unsafe { l.launch(cfg) }, "sample_rows")?;
    if let Some(k) = k {
        let rows_in = b.upload_slice(&args.iter().map(|a| a.row).collect::<Vec<i32>>())?;
        // The ids the kernel wrote are the chosen ids, read where they are.
        crate::ops::logprobs::launch(b, x, po, Some(rows_in.ptr()), count, k, po + (8 * count) as u64)?;
    }
    let mut words = vec![0u32; out.len() / 4];
    b.copy_out(&mut words, &out, "sample_rows")?;
    let picks = (0..count).map(|p| Pick { id: words[p], finite: words[count + p] == 0 }).collect();
    let logprobs = k.map(|k| crate::ops::logprobs::unpack(&words[2 * count..], count, k));
    Ok(Sampled { picks, logprobs })
}

/// The C structs' layouts are these (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    let mut checks = crate::kernels::c_layout!(SampleArgs {
        uniform,
        row,
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        adjust_at,
        adjust_len,
        mask_at,
        pad
    });
    checks.extend(crate::kernels::c_layout!(LogitAdjust { token, bias, penalty, repeated }));
    checks
}
