//! How a step's tokens are laid out as rows of one batch. Sequences that run as single-token
//! steps come first, in waves: wave `j` holds position `j` of every such sequence that runs more
//! than `j` tokens (they are ordered longest first, so a wave is a prefix of them). A plain decode
//! is a sequence of one wave; a verification (speculative decoding) runs its tokens as
//! consecutive single-token steps, so each of its positions computes what a decode step there
//! computes. Prompt chunks follow, each sequence's rows together.

use vt_core::backend::stack_rows;
use vt_core::{Backend, Result, Tensor};

/// Where one prompt chunk's tokens sit in a batched step.
pub(super) struct Span {
    /// First row in the batch.
    pub(super) row: usize,
    pub(super) len: usize,
    /// Position of the first token in the sequence.
    pub(super) start: usize,
}

/// One wave of single-token steps: rows `row..row + seqs`, one for each of the first `seqs`
/// sequences of the step's order.
#[derive(Clone, Copy)]
pub(super) struct Wave {
    pub(super) row: usize,
    pub(super) seqs: usize,
}

pub(super) struct Layout {
    /// The order the step runs the sequences in, as indices into the caller's list: those that
    /// run single-token steps (longest first), then the prompt chunks.
    pub(super) order: Vec<usize>,
    pub(super) waves: Vec<Wave>,
    /// The first position of each sequence that runs single-token steps, in `order`.
    pub(super) starts: Vec<usize>,
    /// The prompt chunks, of `order[starts.len()..]`.
    pub(super) spans: Vec<Span>,
    pub(super) rows: usize,
}

impl Layout {
    /// The layout of sequences that run `tokens` tokens from position `start` each; a sequence
    /// runs single-token steps where it has one token or `stepwise` says so.
    pub(super) fn new(seqs: &[(usize, usize, bool)]) -> Self {
        let single = |&(tokens, _, stepwise): &(usize, usize, bool)| tokens == 1 || stepwise;
        let mut order: Vec<usize> = (0..seqs.len()).filter(|&i| single(&seqs[i])).collect();
        // Longest first, ties in the given order (plain decodes keep the caller's order).
        order.sort_by_key(|&i| std::cmp::Reverse(seqs[i].0));
        let starts: Vec<usize> = order.iter().map(|&i| seqs[i].1).collect();
        let longest = order.first().map_or(0, |&i| seqs[i].0);
        let mut waves = Vec::with_capacity(longest);
        let mut row = 0;
        for j in 0..longest {
            let n = order.iter().take_while(|&&i| seqs[i].0 > j).count();
            waves.push(Wave { row, seqs: n });
            row += n;
        }
        let mut spans = Vec::new();
        for i in (0..seqs.len()).filter(|&i| !single(&seqs[i])) {
            order.push(i);
            spans.push(Span { row, len: seqs[i].0, start: seqs[i].1 });
            row += seqs[i].0;
        }
        Layout { order, waves, starts, spans, rows: row }
    }

    /// The layout of a step's rows.
    pub(super) fn of(rows: &[super::batch::Row<'_>]) -> Self {
        Self::new(&rows.iter().map(|r| (r.ids.len(), r.pos, r.verify)).collect::<Vec<_>>())
    }

    /// Sequences that run single-token steps (the first of `order`).
    pub(super) fn stepwise(&self) -> usize {
        self.starts.len()
    }

    /// The sequences of each wave (`FusedOps::gated_delta_waves`' `waves`).
    pub(super) fn wave_sizes(&self) -> Vec<usize> {
        self.waves.iter().map(|w| w.seqs).collect()
    }

    /// Rows of the waves (the single-token steps), which lead the batch.
    pub(super) fn wave_rows(&self) -> usize {
        self.waves.iter().map(|w| w.seqs).sum()
    }

    /// Whether some sequence runs several single-token steps (a verification).
    pub(super) fn verifies(&self) -> bool {
        self.waves.len() > 1
    }

    /// Whether every row is one wave's (every sequence runs one token).
    pub(super) fn one_wave(&self) -> bool {
        self.waves.len() == 1 && self.spans.is_empty()
    }

    /// The token of each row: `rows[i]`'s tokens on the rows of the sequence it is in `order`.
    pub(super) fn ids(&self, rows: &[super::batch::Row<'_>]) -> Vec<u32> {
        let mut ids = vec![0; self.rows];
        for (k, &i) in self.order.iter().enumerate() {
            for (r, &id) in self.rows_of(k).into_iter().zip(rows[i].ids) {
                ids[r] = id;
            }
        }
        ids
    }

    /// The position of each row.
    pub(super) fn positions(&self) -> Vec<usize> {
        let mut positions = Vec::with_capacity(self.rows);
        for (j, w) in self.waves.iter().enumerate() {
            positions.extend(self.starts[..w.seqs].iter().map(|&s| s + j));
        }
        for sp in &self.spans {
            positions.extend(sp.start..sp.start + sp.len);
        }
        positions
    }

    /// The rows of the sequence at `k` of `order`, in position order.
    pub(super) fn rows_of(&self, k: usize) -> Vec<usize> {
        if k < self.stepwise() {
            self.waves.iter().take_while(|w| w.seqs > k).map(|w| w.row + k).collect()
        } else {
            let sp = &self.spans[k - self.stepwise()];
            (sp.row..sp.row + sp.len).collect()
        }
    }
}

/// Rows `rows` of `x`, in that order (consecutive rows are copied together).
pub(super) fn gather_rows<B: Backend>(b: &B, x: &Tensor<B>, rows: &[usize]) -> Result<Tensor<B>> {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut n = 1;
        while i + n < rows.len() && rows[i + n] == rows[i] + n {
            n += 1;
        }
        parts.push(b.slice_rows(x, rows[i], n)?);
        i += n;
    }
    stack_rows(b, parts)
}

/// Rows `row..row + len` of a batched tensor (a prompt chunk's, or the single-token rows'): the
/// tensor itself, taken, when they are all of it (no copy), else a copy of them.
pub(super) fn take_rows<B: Backend>(b: &B, m: &mut Option<Tensor<B>>, row: usize, len: usize) -> Result<Tensor<B>> {
    let err = || vt_core::Error::input("a batched tensor's rows were taken twice");
    let all = m.as_ref().ok_or_else(err)?;
    if row == 0 && len == all.rows() {
        return m.take().ok_or_else(err);
    }
    b.slice_rows(all, row, len)
}

#[cfg(test)]
mod tests {
    use super::super::batch::Row;
    use super::Layout;

    #[test]
    fn waves_lead_longest_first_and_chunks_follow() {
        // (tokens, start, stepwise): a decode, a 3-token verification, a prompt chunk, a
        // 2-token verification.
        let l = Layout::new(&[(1, 10, false), (3, 20, true), (4, 0, false), (2, 30, true)]);
        assert_eq!(l.order, [1, 3, 0, 2]);
        assert_eq!(l.starts, [20, 30, 10]);
        let waves: Vec<(usize, usize)> = l.waves.iter().map(|w| (w.row, w.seqs)).collect();
        assert_eq!(waves, [(0, 3), (3, 2), (5, 1)]);
        assert_eq!((l.spans[0].row, l.spans[0].len, l.rows), (6, 4, 10));
        assert_eq!(l.rows_of(0), [0, 3, 5]);
        assert_eq!(l.rows_of(1), [1, 4]);
        assert_eq!(l.rows_of(2), [2]);
        assert_eq!(l.rows_of(3), [6, 7, 8, 9]);
        assert!(l.verifies() && !l.one_wave());
        // Each row's position and token, as a recorded step's replays are given them.
        assert_eq!(l.positions(), [20, 30, 10, 21, 31, 22, 0, 1, 2, 3]);
        let toks: [&[u32]; 4] = [&[7], &[20, 21, 22], &[0, 1, 2, 3], &[30, 31]];
        let rows: Vec<Row<'_>> = (toks.iter().zip([10, 20, 0, 30]))
            .map(|(ids, pos)| Row { ids, pos, tables: &[], slot: None, first: None, verify: ids.len() > 1 && pos > 0 })
            .collect();
        assert_eq!(l.ids(&rows), [20, 30, 7, 21, 31, 22, 0, 1, 2, 3]);
        // Plain decodes keep the caller's order in one wave.
        let l = Layout::new(&[(1, 5, false), (1, 7, false)]);
        assert!(l.one_wave() && l.order == [0, 1]);
    }
}
