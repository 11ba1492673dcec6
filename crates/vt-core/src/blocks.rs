//! The host side of a KV block pool: which blocks are free, and how many holders each used block
//! has. Backend-independent: the backend's pool (`KvOps::KvPool`) holds the blocks' contents, this
//! holds their ownership.
//!
//! A block is taken with one reference (`alloc`); every further holder (a forked sequence, a
//! prefix cache) adds one (`share`) and gives it back (`release`). `release` says when the last
//! reference went and the block is free again, so a holder that keeps blocks for later (a prefix
//! cache) sees exactly which of its blocks the others have let go of. Free blocks are handed out
//! lowest id first: a pool that is emptied and filled again hands out the same ids in the same
//! order (a sequence alone gets consecutive blocks).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{Error, Result};

#[derive(Clone, Debug)]
pub struct BlockAllocator {
    /// References to each block; 0 where it is free.
    refs: Vec<u32>,
    free: BinaryHeap<Reverse<u32>>,
}

impl BlockAllocator {
    /// `blocks` free blocks, ids `0..blocks` (fewer than `u32::MAX`: that is `RELEASED`).
    pub fn new(blocks: usize) -> Result<Self> {
        if blocks >= u32::MAX as usize {
            return Err(Error::input(format!("a block pool of {blocks} blocks: block ids are 32-bit")));
        }
        Ok(BlockAllocator { refs: vec![0; blocks], free: (0..blocks as u32).map(Reverse).collect() })
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// Holders of `block` (0: free).
    pub fn refs(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    /// The lowest free block, with one reference; `None` when none is free.
    pub fn alloc(&mut self) -> Option<u32> {
        let Reverse(b) = self.free.pop()?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// `n` blocks, or none (and nothing taken) when fewer than `n` are free.
    pub fn alloc_n(&mut self, n: usize) -> Option<Vec<u32>> {
        (n <= self.free()).then(|| (0..n).map(|_| self.alloc().expect("counted free")).collect())
    }

    /// One more holder of the used `block`.
    pub fn share(&mut self, block: u32) -> Result<()> {
        match self.refs.get_mut(block as usize) {
            Some(r) if *r > 0 => {
                *r = r.checked_add(1).ok_or_else(|| Error::input(format!("block {block}: too many holders")))?;
                Ok(())
            }
            _ => Err(self.not_held("share", block)),
        }
    }

    /// One holder fewer of `block`; `true` when that was the last and the block is free again.
    pub fn release(&mut self, block: u32) -> Result<bool> {
        match self.refs.get_mut(block as usize) {
            Some(r) if *r > 0 => {
                *r -= 1;
                let freed = *r == 0;
                if freed {
                    self.free.push(Reverse(block));
                }
                Ok(freed)
            }
            _ => Err(self.not_held("release", block)),
        }
    }

    fn not_held(&self, op: &str, block: u32) -> Error {
        Error::input(format!("{op}: block {block} is not in use (a pool of {} blocks)", self.total()))
    }
}

#[cfg(test)]
mod tests {
    use super::BlockAllocator;

    #[test]
    fn blocks_come_lowest_first_and_return_when_the_last_holder_releases() {
        let mut a = BlockAllocator::new(4).unwrap();
        assert_eq!(a.alloc_n(3), Some(vec![0, 1, 2]));
        assert_eq!((a.free(), a.used()), (1, 3));
        a.share(1).unwrap();
        a.share(1).unwrap();
        assert_eq!(a.refs(1), 3);
        assert!(!a.release(1).unwrap());
        assert!(!a.release(1).unwrap());
        assert!(a.release(1).unwrap(), "the last holder frees it");
        assert_eq!(a.refs(1), 0);
        assert!(a.release(1).is_err(), "a free block has no holder to release");
        assert!(a.share(1).is_err(), "a free block cannot be shared");
        assert!(a.share(9).is_err() && a.release(9).is_err(), "ids past the pool are errors");
        // 1 and 3 are free: the lower first.
        assert_eq!(a.alloc(), Some(1));
        assert_eq!(a.alloc(), Some(3));
        assert_eq!(a.alloc(), None);
        assert_eq!(a.alloc_n(1), None);
        for b in 0..4 {
            assert!(a.release(b).unwrap());
        }
        assert_eq!(a.alloc_n(4), Some(vec![0, 1, 2, 3]), "an emptied pool hands out the same ids again");
    }

    #[test]
    fn alloc_n_takes_all_or_nothing() {
        let mut a = BlockAllocator::new(3).unwrap();
        assert_eq!(a.alloc(), Some(0));
        assert_eq!(a.alloc_n(3), None);
        assert_eq!(a.free(), 2, "a refused request takes nothing");
        assert_eq!(a.alloc_n(2), Some(vec![1, 2]));
    }
}
