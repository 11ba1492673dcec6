//! A weight's rows in pieces that each fit one binding of the adapter. A vocabulary-sized
//! embedding or lm_head (Qwen3.5-35B-A3B's 248320 x 2048 bf16: 0.95 GiB) exceeds what many
//! adapters bind at once (maxStorageBufferBindingSize: from 128 MiB to 4 GiB), so the embedding
//! and linear ops bind it a range of rows at a time, a dispatch each (as the MoE binds its expert
//! stacks a piece at a time). A piece is a range of each of the weight's buffers, starting at a
//! row whose offset in every one of them the adapter can bind at.

use vt_core::{Result, Weight};

use crate::gpu::{err, Range};
use crate::{FmtWords, WgpuBackend};

/// How one of a weight's buffers holds its rows: `bytes` for each `block` of rows (1, or an FP8
/// weight's scale block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PartRows {
    pub bytes: usize,
    pub block: usize,
}

impl PartRows {
    fn offset(self, row: usize) -> usize {
        row / self.block * self.bytes
    }

    /// Bytes of rows `first..end` (`first` at a block's start), in whole 4-byte words.
    fn len(self, first: usize, end: usize) -> usize {
        ((end.div_ceil(self.block) - first / self.block) * self.bytes).next_multiple_of(4)
    }
}

/// Rows a piece takes: as many as each part binds within `limit` bytes, a multiple of the rows
/// at which every part's offset is a multiple of `align`. `None` when the weight binds whole.
pub(crate) fn rows_per_piece(parts: &[PartRows], n: usize, limit: usize, align: usize) -> Result<Option<usize>> {
    if parts.iter().all(|p| p.len(0, n) <= limit) {
        return Ok(None);
    }
    let step = parts.iter().fold(1, |g, p| lcm(g, p.block * (align / gcd(align, p.bytes))));
    let fit = parts.iter().map(|p| (limit & !3) / p.bytes.max(1) * p.block).min().unwrap_or(0);
    let rows = fit / step * step;
    if rows == 0 {
        return Err(err(format!(
            "a weight of {n} rows does not split to the adapter's storage binding limit of {limit} bytes \
             (pieces of {step} rows, at offsets it binds: multiples of {align})"
        )));
    }
    Ok(Some(rows))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// Rows `first..end` of a weight and its buffers' ranges for them.
pub(crate) struct RowPiece<'a> {
    pub first: usize,
    pub end: usize,
    pub ranges: [Range<'a>; 3],
}

impl WgpuBackend {
    /// The weight's format words and its rows in pieces; `keep` holds NVFP4's global scale for
    /// the call.
    pub(crate) fn row_pieces<'a>(
        &self,
        w: &'a Weight<Self>,
        keep: &'a mut Option<wgpu::Buffer>,
    ) -> Result<(FmtWords, Vec<RowPiece<'a>>)> {
        let (n, k) = w.dims();
        let (fmt, ranges) = self.weight_parts(w, keep)?;
        let parts = match w {
            Weight::Dense(t) => vec![PartRows { bytes: t.dtype().bytes_for(k).unwrap_or(0), block: 1 }],
            Weight::Nvfp4(_) => vec![PartRows { bytes: k / 2, block: 1 }, PartRows { bytes: k / 16, block: 1 }],
            Weight::Fp8(q) => {
                vec![PartRows { bytes: k, block: 1 }, PartRows { bytes: k.div_ceil(q.block[1]) * 4, block: q.block[0] }]
            }
        };
        Ok((fmt, self.pieces(n, &parts, ranges)?))
    }

    /// `n` rows held as `parts` say in the first ranges of `ranges`, in pieces (one, the whole
    /// ranges, where they bind whole). A further range bound to one of those (where a format
    /// has fewer buffers than bindings) follows it.
    pub(crate) fn pieces<'a>(&self, n: usize, parts: &[PartRows], ranges: [Range<'a>; 3]) -> Result<Vec<RowPiece<'a>>> {
        let limits = &self.gpu.limits;
        let (limit, align) =
            (limits.max_storage_buffer_binding_size as usize, limits.min_storage_buffer_offset_alignment as usize);
        let Some(rows) = rows_per_piece(parts, n, limit, align)? else {
            return Ok(vec![RowPiece { first: 0, end: n, ranges }]);
        };
        let same = |a: &Range<'_>, b: &Range<'_>| std::ptr::eq(a.buffer, b.buffer) && a.offset == b.offset;
        let split = parts.len();
        Ok((0..n)
            .step_by(rows)
            .map(|first| {
                let end = (first + rows).min(n);
                let mut piece = ranges;
                for (r, p) in piece.iter_mut().zip(parts) {
                    r.offset += p.offset(first) as u64;
                    r.size = p.len(first, end) as u64;
                }
                for i in split..piece.len() {
                    if let Some(j) = (0..split).find(|&j| same(&ranges[i], &ranges[j])) {
                        piece[i] = piece[j];
                    }
                }
                RowPiece { first, end, ranges: piece }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(bytes: usize) -> PartRows {
        PartRows { bytes, block: 1 }
    }

    #[test]
    fn a_weight_that_fits_binds_whole() {
        assert_eq!(rows_per_piece(&[dense(4096)], 100, 4096 * 100, 256).unwrap(), None);
    }

    /// Qwen3.5-35B-A3B's lm_head (bf16 rows of 4096 bytes) at a 128 MiB limit: 32768 rows a
    /// piece, 8 pieces for 248320 rows.
    #[test]
    fn a_vocabulary_splits_at_the_limit() {
        let rows = rows_per_piece(&[dense(4096)], 248_320, 128 << 20, 256).unwrap().unwrap();
        assert_eq!(rows, 32_768);
        assert_eq!(248_320usize.div_ceil(rows), 8);
    }

    /// Every part's piece offsets bind and every piece fits: rows of 72 bytes at an alignment of
    /// 256 start every 32 rows (32 * 72 = 9 * 256); NVFP4 (k / 2 and k / 16 bytes a row) and FP8
    /// blocks (values k bytes a row, a row of f32 scales a block of 128 rows) too.
    #[test]
    fn pieces_start_where_the_adapter_binds_and_fit() {
        let fp8 = [dense(2048), PartRows { bytes: 16 * 4, block: 128 }];
        let cases: [(&[PartRows], &[usize]); 3] = [
            (&[dense(72)], &[4096, 10_000, 65_536]),
            (&[dense(40), dense(5)], &[16_384, 65_536]),
            (&fp8, &[1 << 20, 3 << 20, 5_000_000]),
        ];
        for (parts, limits) in cases {
            for &limit in limits {
                let rows = rows_per_piece(parts, 50_000, limit, 256).unwrap().unwrap();
                for p in parts {
                    assert_eq!(p.offset(rows) % 256, 0, "{parts:?} at {limit}: {rows} rows a piece");
                    assert!(p.len(0, rows) <= limit, "{parts:?} at {limit}: {rows} rows a piece");
                }
            }
        }
        assert_eq!(rows_per_piece(&[dense(72)], 5000, 4096, 256).unwrap(), Some(32));
        assert_eq!(rows_per_piece(&fp8, 50_000, 3 << 20, 256).unwrap(), Some(1536));
    }

    #[test]
    fn rows_too_large_for_an_aligned_piece_are_an_error() {
        let e = rows_per_piece(&[dense(72)], 5000, 1000, 256).unwrap_err().to_string();
        assert!(e.contains("does not split"), "{e}");
    }
}
