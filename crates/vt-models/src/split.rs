//! Which part of each module a tensor-parallel rank holds (docs/parallel.md): heads by query
//! head (key-value heads replicated where a group's queries span ranks), feed-forward units and
//! vocabulary rows as evenly as integer division allows.

use std::ops::Range;

use vt_core::{Error, Result};

/// One rank of `ranks`, and whether routed experts are split by expert (expert parallelism)
/// rather than each expert's hidden units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
    pub expert_parallel: bool,
}

/// A rank's heads of one mixer: query (or value) heads, and the key-value (or key) heads they read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heads {
    pub q: Range<usize>,
    pub kv: Range<usize>,
}

impl Shard {
    /// The whole model on one rank.
    pub const ALONE: Shard = Shard { rank: 0, ranks: 1, expert_parallel: false };

    pub fn is_alone(&self) -> bool {
        self.ranks == 1
    }

    /// This rank's part of `units`: `[r * units / n, (r + 1) * units / n)` (empty where there are
    /// fewer units than ranks).
    pub fn even(&self, units: usize) -> Range<usize> {
        self.rank * units / self.ranks..(self.rank + 1) * units / self.ranks
    }

    /// This rank's query heads (an even split) and the key-value heads they read, for a mixer of
    /// `q_heads` heads over `kv_heads` (each serving `q_heads / kv_heads` consecutive ones). A rank
    /// must get at least one query head, and its heads either lie in one group (its key-value head
    /// is then replicated on the ranks that share the group) or be whole groups; `what` names the
    /// mixer in the error otherwise.
    pub fn heads(&self, q_heads: usize, kv_heads: usize, what: &str) -> Result<Heads> {
        let reason = |why: String| {
            Err(Error::UnsupportedModel(format!(
                "{what}: tensor parallelism over {} ranks: rank {} {why}",
                self.ranks, self.rank
            )))
        };
        if kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return reason(format!("cannot split {q_heads} query heads over {kv_heads} key-value heads"));
        }
        let group = q_heads / kv_heads;
        let q = self.even(q_heads);
        if q.is_empty() {
            return reason(format!("gets none of the {q_heads} query heads (use at most {q_heads} ranks)"));
        }
        let kv = q.start / group..q.end.div_ceil(group);
        if kv.len() > 1 && !(q.start.is_multiple_of(group) && q.end.is_multiple_of(group)) {
            return reason(format!(
                "gets query heads {q:?}, which cover part of more than one group of {group} sharing a key-value head \
                 (use a rank count that divides {kv_heads} or {q_heads} evenly)"
            ));
        }
        Ok(Heads { q, kv })
    }
}

/// `r` scaled by `by` (head ranges to row or column ranges).
pub fn scaled(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start * by..r.end * by
}

/// `r` moved by `by`.
pub fn offset(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(rank: usize, ranks: usize) -> Shard {
        Shard { rank, ranks, expert_parallel: false }
    }

    #[test]
    fn even_parts_cover_every_unit_once() {
        for ranks in 1..6 {
            for units in 0..20 {
                let parts: Vec<_> = (0..ranks).map(|r| shard(r, ranks).even(units)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[ranks - 1].end, units);
                assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
                assert!(parts.iter().all(|p| p.len() <= units.div_ceil(ranks) && p.len() >= units / ranks));
            }
        }
    }

    #[test]
    fn heads_replicate_a_shared_group_and_refuse_what_cannot_split() {
        // 6 query heads over 2 key-value heads on 4 ranks: [0,1) [1,3) [3,4) [4,6).
        let h: Vec<_> = (0..4).map(|r| shard(r, 4).heads(6, 2, "layer 0").unwrap()).collect();
        assert_eq!(h.iter().map(|h| h.q.clone()).collect::<Vec<_>>(), [0..1, 1..3, 3..4, 4..6]);
        assert_eq!(h.iter().map(|h| h.kv.clone()).collect::<Vec<_>>(), [0..1, 0..1, 1..2, 1..2]);
        // Whole groups: 8 over 4 on 2 ranks.
        assert_eq!(shard(1, 2).heads(8, 4, "x").unwrap(), Heads { q: 4..8, kv: 2..4 });
        // Fewer query heads than ranks.
        let e = shard(0, 4).heads(2, 2, "layer 3 attention").unwrap_err().to_string();
        assert!(e.contains("layer 3 attention") && e.contains("none of the 2 query heads"), "{e}");
        // 8 over 2 on 3 ranks: rank 1 gets [2, 5), across the groups [0, 4) and [4, 8).
        let e = shard(1, 3).heads(8, 2, "x").unwrap_err().to_string();
        assert!(e.contains("more than one group"), "{e}");
    }
}
