//! The prefix cache's index: which full KV blocks hold which tokens, and at which block ends a
//! snapshot of the linear-attention state waits.
//!
//! A block's key is a hash chain: the hash of its parent's key and its own token ids, so equal
//! keys mean equal prefixes up to that block, from the first token. The hash alone decides
//! nothing: an entry keeps its tokens and its parent's key, and a lookup or insert accepts an
//! entry only when both are equal to what it walks (by induction from the first block, the whole
//! prefix is then equal). A collision therefore costs a miss, never a wrong hit; that is why a
//! 64-bit hash suffices, and the hasher is seeded per index (`RandomState`), so no input can be
//! built to collide on purpose either.
//!
//! Blocks and snapshots are the caller's ids (`B`, `S`); the index decides what to keep and what
//! to give back, the caller owns the memory (a reference on each block the index holds, a slot
//! per snapshot). Eviction takes the least recently used entry that no other entry continues (a
//! leaf) and whose block no sequence holds: parents outlive their children, so every cached
//! block stays reachable from the first.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher, RandomState};

/// Counts since the index was made, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompts looked up.
    pub lookups: u64,
    /// Lookups that found a cached prefix.
    pub hits: u64,
    /// Tokens of the prompts looked up.
    pub prompt_tokens: u64,
    /// Of those, tokens whose prefill a hit skipped.
    pub hit_tokens: u64,
}

/// A cached prefix of a prompt: `blocks` hold its `tokens` positions, and `snapshot` is the
/// linear-attention state after them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit<B, S> {
    pub tokens: usize,
    pub blocks: Vec<B>,
    pub snapshot: S,
}

/// What the index gave back or took when asked to cache a sequence's blocks.
#[derive(Debug, PartialEq, Eq)]
pub struct Inserted<B, S> {
    /// Blocks the index now refers to: the caller takes a reference on each for it.
    pub taken: Vec<B>,
    /// The snapshot, when the index already had one there (or could not place it): the caller
    /// frees it.
    pub unused: Option<S>,
}

/// What eviction removed: the caller releases the block and frees the snapshot.
#[derive(Debug, PartialEq, Eq)]
pub struct Evicted<B, S> {
    pub block: B,
    pub snapshot: Option<S>,
}

struct Entry<B, S> {
    parent: Option<u64>,
    tokens: Box<[u32]>,
    block: B,
    snapshot: Option<S>,
    /// Entries whose parent this is.
    children: usize,
    /// Tick of the last lookup or insert that walked through it.
    used: u64,
}

pub struct PrefixIndex<B, S> {
    block: usize,
    hasher: RandomState,
    entries: HashMap<u64, Entry<B, S>>,
    /// Entries without children, by `used`: eviction's candidates, oldest first.
    leaves: BTreeMap<u64, u64>,
    /// Entries with a snapshot, by `used`.
    snapshots: BTreeMap<u64, u64>,
    tick: u64,
    stats: PrefixStats,
}

impl<B: Copy, S: Copy> PrefixIndex<B, S> {
    /// An empty index of blocks of `block` positions.
    pub fn new(block: usize) -> Self {
        PrefixIndex {
            block: block.max(1),
            hasher: RandomState::new(),
            entries: HashMap::new(),
            leaves: BTreeMap::new(),
            snapshots: BTreeMap::new(),
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Blocks cached.
    pub fn blocks(&self) -> usize {
        self.entries.len()
    }

    /// Snapshots cached.
    pub fn snapshots(&self) -> usize {
        self.snapshots.len()
    }

    fn key(&self, parent: Option<u64>, tokens: &[u32]) -> u64 {
        let mut h = self.hasher.build_hasher();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// The entry that continues `parent` with `tokens`, if cached (its content checked).
    fn find(&self, parent: Option<u64>, tokens: &[u32]) -> Option<u64> {
        let key = self.key(parent, tokens);
        let e = self.entries.get(&key)?;
        (e.parent == parent && *e.tokens == *tokens).then_some(key)
    }

    /// Marks `key` as used now.
    fn touch(&mut self, key: u64) {
        self.tick += 1;
        let tick = self.tick;
        let e = self.entries.get_mut(&key).expect("touching an entry that exists");
        let old = std::mem::replace(&mut e.used, tick);
        if e.children == 0 {
            self.leaves.remove(&old);
            self.leaves.insert(tick, key);
        }
        if e.snapshot.is_some() {
            self.snapshots.remove(&old);
            self.snapshots.insert(tick, key);
        }
    }

    /// The keys of the longest cached prefix of `prompt` that leaves at least one token of it to
    /// run (the last prompt token must be computed for its logits), and how many of them lead to
    /// the last one with a snapshot.
    fn walk(&self, prompt: &[u32]) -> (Vec<u64>, usize) {
        let (mut path, mut best, mut parent) = (Vec::new(), 0, None);
        for (i, tokens) in prompt.chunks_exact(self.block).enumerate() {
            if (i + 1) * self.block >= prompt.len() {
                break;
            }
            let Some(key) = self.find(parent, tokens) else { break };
            path.push(key);
            if self.entries[&key].snapshot.is_some() {
                best = path.len();
            }
            parent = Some(key);
        }
        (path, best)
    }

    /// Tokens of `prompt` that `lookup` would find cached (nothing counted or marked used).
    pub fn peek(&self, prompt: &[u32]) -> usize {
        self.walk(prompt).1 * self.block
    }

    /// Tokens of `prompt` whose blocks are cached, snapshot or not, short of its last token:
    /// where a prompt that goes on differently from a cached one leaves it (a snapshot there
    /// lets later prompts with that prefix hit).
    pub fn matched(&self, prompt: &[u32]) -> usize {
        self.walk(prompt).0.len() * self.block
    }

    /// The longest cached prefix of `prompt` that ends in a snapshot and leaves at least one
    /// token of it to run. Counts the lookup, and marks what it used as recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit<B, S>> {
        self.stats.lookups += 1;
        self.stats.prompt_tokens += prompt.len() as u64;
        let (mut path, best) = self.walk(prompt);
        path.truncate(best);
        let last = *path.last()?;
        for &key in &path {
            self.touch(key);
        }
        let hit = Hit {
            tokens: path.len() * self.block,
            blocks: path.iter().map(|k| self.entries[k].block).collect(),
            snapshot: self.entries[&last].snapshot.expect("the hit ends in a snapshot"),
        };
        self.stats.hits += 1;
        self.stats.hit_tokens += hit.tokens as u64;
        Some(hit)
    }

    /// Caches a sequence's full blocks: `blocks[i]` holds `tokens[i * block..(i + 1) * block]`
    /// (`tokens` is as long as the blocks), and `snapshot`, if given, is the linear-attention
    /// state after the last of them. Where a block's prefix is cached already, the cached entry
    /// stays and the sequence's block is not taken.
    pub fn insert(&mut self, tokens: &[u32], blocks: &[B], snapshot: Option<S>) -> Inserted<B, S> {
        let mut out = Inserted { taken: Vec::new(), unused: snapshot };
        if tokens.len() != blocks.len() * self.block {
            return out;
        }
        let mut parent = None;
        for (chunk, &block) in tokens.chunks_exact(self.block).zip(blocks) {
            let key = self.key(parent, chunk);
            match self.entries.get(&key) {
                Some(e) if e.parent == parent && *e.tokens == *chunk => {}
                // Another prefix with this key (a hash collision): this chain is not cached further.
                Some(_) => return out,
                None => {
                    self.entries.insert(
                        key,
                        Entry { parent, tokens: chunk.into(), block, snapshot: None, children: 0, used: 0 },
                    );
                    if let Some(p) = parent {
                        self.adopt(p);
                    }
                    out.taken.push(block);
                }
            }
            self.touch(key);
            parent = Some(key);
        }
        if let (Some(key), Some(s)) = (parent, out.unused) {
            let e = self.entries.get_mut(&key).expect("the chain's last entry");
            if e.snapshot.is_none() {
                e.snapshot = Some(s);
                self.snapshots.insert(e.used, key);
                out.unused = None;
            }
        }
        out
    }

    /// `parent` gained a child: it is no longer a leaf.
    fn adopt(&mut self, parent: u64) {
        let e = self.entries.get_mut(&parent).expect("a parent entry");
        if e.children == 0 {
            self.leaves.remove(&e.used);
        }
        e.children += 1;
    }

    /// Removes the least recently used leaf whose block `unheld` says no sequence holds.
    pub fn evict(&mut self, mut unheld: impl FnMut(&B) -> bool) -> Option<Evicted<B, S>> {
        let key = self.leaves.values().copied().find(|k| unheld(&self.entries[k].block))?;
        let e = self.entries.remove(&key).expect("a leaf entry");
        self.leaves.remove(&e.used);
        if e.snapshot.is_some() {
            self.snapshots.remove(&e.used);
        }
        if let Some(p) = e.parent {
            let pe = self.entries.get_mut(&p).expect("a parent outlives its children");
            pe.children -= 1;
            if pe.children == 0 {
                self.leaves.insert(pe.used, p);
            }
        }
        Some(Evicted { block: e.block, snapshot: e.snapshot })
    }

    /// Removes the least recently used snapshot (its blocks stay cached).
    pub fn evict_snapshot(&mut self) -> Option<S> {
        let (_, key) = self.snapshots.pop_first()?;
        self.entries.get_mut(&key).expect("a snapshot's entry").snapshot.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn hits_the_longest_snapshotted_prefix_and_leaves_a_token() {
        let mut ix = PrefixIndex::<u32, u32>::new(4);
        let p = seq(12, 0);
        // Blocks 10, 11, 12 hold p[0..12]; snapshots after 8 (via a shorter insert) and 12.
        let ins = ix.insert(&p[..8], &[10, 11], Some(100));
        assert_eq!(ins, Inserted { taken: vec![10, 11], unused: None });
        let ins = ix.insert(&p, &[20, 21, 12], Some(101));
        assert_eq!(ins, Inserted { taken: vec![12], unused: None }, "cached blocks stay, new ones are taken");
        assert_eq!(ix.blocks(), 3);
        // The same prompt: the last block would leave nothing to run, so the hit stops at 8.
        assert_eq!(ix.peek(&p), 8);
        assert_eq!(ix.matched(&p), 8, "the last block would leave nothing to run");
        assert_eq!(ix.lookup(&p), Some(Hit { tokens: 8, blocks: vec![10, 11], snapshot: 100 }));
        let mut longer = p.clone();
        longer.push(5);
        assert_eq!(ix.lookup(&longer), Some(Hit { tokens: 12, blocks: vec![10, 11, 12], snapshot: 101 }));
        // A different first block misses, however long the rest matches.
        let mut other = longer.clone();
        other[0] += 1;
        assert_eq!(ix.lookup(&other), None);
        // Too short to leave a token after the first snapshot.
        assert_eq!(ix.lookup(&p[..8]), None);
        let st = ix.stats();
        assert_eq!((st.lookups, st.hits, st.hit_tokens), (4, 2, 20));
        assert_eq!(st.prompt_tokens, (12 + 13 + 13 + 8) as u64);
    }

    #[test]
    fn a_prefix_without_snapshot_is_no_hit() {
        let mut ix = PrefixIndex::<u32, u32>::new(4);
        let p = seq(9, 3);
        ix.insert(&p[..8], &[1, 2], None);
        assert_eq!((ix.peek(&p), ix.matched(&p)), (0, 8));
        assert_eq!(ix.lookup(&p), None);
        // A second insert of the same blocks brings the snapshot; the blocks are not taken twice.
        assert_eq!(ix.insert(&p[..8], &[3, 4], Some(7)), Inserted { taken: vec![], unused: None });
        assert_eq!(ix.lookup(&p).map(|h| (h.tokens, h.blocks)), Some((8, vec![1, 2])));
        // A third snapshot of the same prefix is not needed: it comes back.
        assert_eq!(ix.insert(&p[..8], &[5, 6], Some(8)), Inserted { taken: vec![], unused: Some(8) });
        // Tokens that do not fill whole blocks are refused whole.
        assert_eq!(ix.insert(&p, &[1, 2], Some(9)), Inserted { taken: vec![], unused: Some(9) });
    }

    /// A key shared by two different prefixes (forced by planting an entry under the key another
    /// prefix hashes to) is never taken for the other prefix.
    #[test]
    fn a_hash_collision_misses_instead_of_hitting_wrongly() {
        let mut ix = PrefixIndex::<u32, u32>::new(2);
        let (a, b) = (vec![1, 2, 3], vec![4, 5, 6]);
        ix.insert(&a[..2], &[1], Some(10));
        let key_b = ix.key(None, &b[..2]);
        let e = ix.entries.remove(&ix.key(None, &a[..2])).unwrap();
        ix.entries.insert(key_b, e);
        assert_eq!(ix.lookup(&b), None, "same key, other tokens");
        assert_eq!(ix.insert(&b[..2], &[2], Some(11)), Inserted { taken: vec![], unused: Some(11) });
    }

    #[test]
    fn evicts_least_recently_used_leaves_not_held_and_parents_after_children() {
        let mut ix = PrefixIndex::<u32, u32>::new(2);
        let (a, b) = (seq(7, 0), seq(7, 1));
        ix.insert(&a[..6], &[1, 2, 3], Some(10));
        ix.insert(&b[..4], &[4, 5], Some(11));
        assert!(ix.lookup(&a).is_some()); // a is now more recent than b
        let held = [5u32];
        let mut order = Vec::new();
        while let Some(e) = ix.evict(|blk| !held.contains(blk)) {
            order.push((e.block, e.snapshot));
        }
        // b's leaf is held, so b's blocks stay; a goes leaf first.
        assert_eq!(order, vec![(3, Some(10)), (2, None), (1, None)]);
        assert_eq!(ix.blocks(), 2);
        assert_eq!(ix.evict(|_| true), Some(Evicted { block: 5, snapshot: Some(11) }));
        assert_eq!(ix.evict(|_| true), Some(Evicted { block: 4, snapshot: None }));
        assert_eq!(ix.evict(|_| true), None);
        assert_eq!((ix.blocks(), ix.snapshots()), (0, 0));
    }

    #[test]
    fn snapshots_evict_on_their_own_oldest_first() {
        let mut ix = PrefixIndex::<u32, u32>::new(2);
        let (a, b) = (seq(5, 0), seq(5, 1));
        ix.insert(&a[..4], &[1, 2], Some(10));
        ix.insert(&b[..4], &[3, 4], Some(11));
        ix.lookup(&a);
        assert_eq!(ix.evict_snapshot(), Some(11));
        assert_eq!(ix.lookup(&b), None, "blocks without a snapshot at their end are no hit");
        assert_eq!(ix.blocks(), 4);
        assert_eq!(ix.evict_snapshot(), Some(10));
        assert_eq!(ix.evict_snapshot(), None);
    }
}
