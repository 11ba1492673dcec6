//! NVFP4 weights as this backend keeps them: the tiled layout of kernels/nvfp4.cuh, built once at
//! load (`Device::nvfp4_parts`) on the device from the checkpoint's bytes, which are then given
//! back. It is the weight's only device form: the decode GEMV, the fused MoE decode block, the
//! tensor-core prefill (w4a16.rs) and the general kernels' `w_at` all read it, so an NVFP4 weight
//! takes the checkpoint's bytes on the device (exactly, for whole 16 x 64 tiles; rows and inputs
//! past the matrix are zero padding).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vt_core::{DType, Result, Tensor};

use crate::device::CudaBackend;
use crate::error::check;
use crate::launch::{i32_of, launched};
use crate::limits::{NV4_K, NV4_ROWS};

/// Bytes of a tile's codes and of its scales.
pub(crate) const CODE_BYTES: usize = NV4_ROWS * NV4_K / 2;
pub(crate) const SCALE_BYTES: usize = NV4_ROWS * NV4_K / 16;

/// Bytes of `rows` bf16 rows of `k` inputs staged as the decode kernels' B fragments
/// (kernels/nvfp4.cuh: nv4_stage_round): 128 a 64-input tile, the last one padded.
pub(crate) fn frag_bytes(rows: usize, k: usize) -> usize {
    rows * k.div_ceil(NV4_K) * 128
}

/// Tiles of a `[n, k]` matrix: row blocks times k tiles.
fn tiles(n: usize, k: usize) -> usize {
    n.div_ceil(NV4_ROWS) * k.div_ceil(NV4_K)
}

/// The tiled form of `codes` (`F4x2 [n, k]`) and `scales` (`F8E4M3 [n, k / 16]`), both in the
/// checkpoint's layout on this device and checked against each other (`Nvfp4::new`): new tensors
/// of the same logical shapes; the inputs are dropped (freed in stream order, after the repack).
pub(crate) fn device_parts(
    b: &CudaBackend,
    codes: Tensor<CudaBackend>,
    scales: Tensor<CudaBackend>,
) -> Result<(Tensor<CudaBackend>, Tensor<CudaBackend>)> {
    let (n, k) = (codes.shape()[0], codes.shape()[1]);
    let tiles = tiles(n, k);
    check(
        k.is_multiple_of(16) && scales.shape() == [n, k / 16] && u32::try_from(tiles).is_ok(),
        "nvfp4 repack",
        || format!("NVFP4 matrix [{n}, {k}] with scales {:?}", scales.shape()),
    )?;
    let (codes_out, scales_out) = (b.buffer(tiles * CODE_BYTES)?, b.buffer(tiles * SCALE_BYTES)?);
    let (pc, ps, pcin, psin) = (codes_out.ptr(), scales_out.ptr(), codes.buffer().ptr(), scales.buffer().ptr());
    let (ni, ki) = (i32_of(n, "rows")?, i32_of(k, "inputs")?);
    let mut l = b.stream().launch_builder(&b.k().nvfp4_repack);
    l.arg(&pc).arg(&ps).arg(&pcin).arg(&psin).arg(&ni).arg(&ki);
    let cfg = LaunchConfig { grid_dim: (tiles as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: nvfp4_repack(unsigned char* codes_out, unsigned char* scales_out, const unsigned
    // char* codes, const unsigned char* scales, int n, int k): one block of 128 threads per tile,
    // writing its CODE_BYTES and SCALE_BYTES of the fresh buffers sized for all `tiles`; it reads
    // codes [n, k / 2] and scales [n, k / 16] only at rows < n and inputs < k (checked shapes of
    // the live input tensors, dropped after the launch is queued: stream-ordered frees).
    launched(unsafe { l.launch(cfg) }, "nvfp4_repack")?;
    Ok((
        Tensor::from_parts(codes_out, DType::F4x2, vec![n, k]),
        Tensor::from_parts(scales_out, DType::F8E4M3, vec![n, k / 16]),
    ))
}

/// The layout as the kernels define it, on the host: what the tests hold the kernels' two views
/// of it (the repack's fragment order, `w_at`'s element address) to.
#[cfg(test)]
pub(crate) mod host {
    use super::{tiles, CODE_BYTES, NV4_K, NV4_ROWS, SCALE_BYTES};

    /// `nv4_sign_bit` (kernels/common.cuh): the word bit of element e's sign.
    pub(crate) fn sign_bit(e: usize) -> usize {
        if e < 4 {
            8 * e + 7
        } else {
            8 * (e - 4) + 3
        }
    }

    /// nvfp4_repack on the host: for each tile, lane (g, c) and step s, the word of the 8 codes of
    /// the lane's fragment elements e (row g + 8 (e >> 2), input 16 s + 2c + 8 ((e >> 1) & 1) +
    /// (e & 1)); scale byte 8 g + 4 h + s for row 8 h + g, step s.
    pub(crate) fn repack(n: usize, k: usize, codes: &[u8], scales: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let kt_n = k.div_ceil(NV4_K);
        let (mut co, mut so) = (vec![0u8; tiles(n, k) * CODE_BYTES], vec![0u8; tiles(n, k) * SCALE_BYTES]);
        for tile in 0..tiles(n, k) {
            let (rb, kb) = (tile / kt_n, tile % kt_n);
            for lane in 0..32 {
                let (g, c) = (lane / 4, lane % 4);
                for s in 0..4 {
                    let mut word = 0u32;
                    for e in 0..8 {
                        let row = NV4_ROWS * rb + g + 8 * (e >> 2);
                        let col = NV4_K * kb + 16 * s + 2 * c + 8 * ((e >> 1) & 1) + (e & 1);
                        let code =
                            if row < n && col < k { (codes[row * k / 2 + col / 2] >> (4 * (col & 1))) & 15 } else { 0 };
                        word |= u32::from(code & 7) << (4 * e);
                        word |= u32::from(code >> 3) << sign_bit(e);
                    }
                    let at = tile * CODE_BYTES + 16 * lane + 4 * s;
                    co[at..at + 4].copy_from_slice(&word.to_le_bytes());
                }
            }
            for (i, byte) in so[tile * SCALE_BYTES..][..SCALE_BYTES].iter_mut().enumerate() {
                let (g, h, s) = (i >> 3, (i >> 2) & 1, i & 3);
                let (row, group) = (NV4_ROWS * rb + 8 * h + g, 4 * kb + s);
                *byte = if row < n && group < k / 16 { scales[row * (k / 16) + group] } else { 0 };
            }
        }
        (co, so)
    }

    /// `w_at<DT_NVFP4>`'s address arithmetic (kernels/common.cuh): element (row, j)'s code and
    /// scale byte in the tiled parts.
    pub(crate) fn at(k: usize, codes: &[u8], scales: &[u8], row: usize, j: usize) -> (u8, u8) {
        let tile = (row >> 4) * k.div_ceil(NV4_K) + j / NV4_K;
        let (r, jj) = (row & 15, j % NV4_K);
        let (g, h, s, kk) = (r & 7, r >> 3, jj >> 4, jj & 15);
        let (c, e) = ((kk >> 1) & 3, 4 * h + 2 * (kk >> 3) + (kk & 1));
        let w = tile * (NV4_ROWS * NV4_K / 8) + (4 * g + c) * 4 + s;
        let word = u32::from_le_bytes(codes[4 * w..4 * w + 4].try_into().unwrap());
        let code = ((word >> (4 * e)) & 7) | (((word >> sign_bit(e)) & 1) << 3);
        (code as u8, scales[tile * (NV4_ROWS * NV4_K / 16) + 8 * g + 4 * h + s])
    }
}

/// The kernels' tile sizes are these (kernels.rs's tests).
#[cfg(test)]
pub(crate) fn mirrors() -> Vec<String> {
    use crate::kernels::c_equal;
    vec![c_equal("NV4_CODE_BYTES", CODE_BYTES), c_equal("NV4_SCALE_BYTES", SCALE_BYTES)]
}

#[cfg(test)]
mod tests {
    use super::host::{at, repack};
    use super::{tiles, CODE_BYTES, SCALE_BYTES};

    fn bytes(len: usize, mut s: u64) -> Vec<u8> {
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// The repack's fragment order and `w_at`'s element addresses are one layout: every element
    /// of the matrix reads back, through `at`, the code and scale the checkpoint gives it; whole
    /// tiles take exactly the checkpoint's bytes, and partial ones pad with zeros.
    #[test]
    fn every_element_reads_back_its_checkpoint_code_and_scale() {
        for (n, k) in [(16, 64), (32, 128), (1, 16), (300, 208), (136, 336), (17, 80)] {
            let (codes, scales) = (bytes(n * k / 2, 7 + n as u64), bytes(n * k / 16, 11 + k as u64));
            let (co, so) = repack(n, k, &codes, &scales);
            assert_eq!((co.len(), so.len()), (tiles(n, k) * CODE_BYTES, tiles(n, k) * SCALE_BYTES));
            if n % 16 == 0 && k % 64 == 0 {
                assert_eq!((co.len(), so.len()), (n * k / 2, n * k / 16), "[{n}, {k}] takes the checkpoint's bytes");
            }
            for row in 0..n {
                for j in 0..k {
                    let code = (codes[(row * k + j) / 2] >> (4 * (j & 1))) & 15;
                    assert_eq!(
                        at(k, &co, &so, row, j),
                        (code, scales[row * k / 16 + j / 16]),
                        "[{n}, {k}] ({row}, {j})"
                    );
                }
            }
            let live = (0..n).flat_map(|row| (0..k).map(move |j| (row, j))).count();
            let nonzero_codes: usize = co.iter().map(|b| b.count_ones() as usize).sum();
            let checkpoint_ones: usize = codes.iter().map(|b| b.count_ones() as usize).sum();
            assert_eq!(nonzero_codes, checkpoint_ones, "[{n}, {k}]: {live} elements, padding all zeros");
        }
    }

    /// What nv4_codes (kernels/nvfp4.cuh) makes of a word is the mma m16n8k16 A fragment of the
    /// lane (PTX ISA: a0 row g, inputs 2c, 2c + 1; a1 row g + 8; a2 row g, inputs 2c + 8, 2c + 9;
    /// a3 row g + 8), read as the decode reads the word: the byte lookups take nibbles 0-3 (low
    /// halves' pair a0, a2) and 4-7 (a1, a3) with the signs or-ed on from the high bits of `q &
    /// 0x80808080` and of `(q << 4) & 0x80808080`, one per byte.
    #[test]
    fn a_decoded_word_is_the_lanes_a_fragment() {
        let (n, k) = (16, 64);
        let (codes, scales) = (bytes(n * k / 2, 3), bytes(n * k / 16, 5));
        let (co, _) = repack(n, k, &codes, &scales);
        let code_of = |row: usize, j: usize| (codes[(row * k + j) / 2] >> (4 * (j & 1))) & 15;
        for lane in 0..32 {
            let (g, c) = (lane / 4, lane % 4);
            for s in 0..4 {
                let q = u32::from_le_bytes(co[16 * lane + 4 * s..][..4].try_into().unwrap());
                // Nibble nib's code: its magnitude, and the sign bit of byte nib % 4 of the
                // or-ed sign word (q for nibbles 0-3, q << 4 for 4-7).
                let code = |nib: u32| {
                    let signs = if nib < 4 { q } else { q << 4 };
                    (((q >> (4 * nib)) & 7) | (((signs >> (8 * (nib % 4) + 7)) & 1) << 3)) as u8
                };
                let regs = [[code(0), code(1)], [code(4), code(5)], [code(2), code(3)], [code(6), code(7)]];
                for (i, reg) in regs.iter().enumerate() {
                    let (row, j0) = (g + 8 * (i & 1), 16 * s + 2 * c + 8 * (i >> 1));
                    assert_eq!(*reg, [code_of(row, j0), code_of(row, j0 + 1)], "lane {lane} step {s} a{i}");
                }
            }
        }
    }
}
