//! How the ranks of one model exchange activations: the collectives tensor parallelism needs
//! (`Communicator`), and an implementation for ranks that are threads of this process exchanging
//! through host memory (`HostComm`: CPU CI runs every parallel path on it, on any backend).
//! vt-cuda implements the trait over NCCL.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::backend::Device;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// One rank's end of a group of `ranks()` ranks. Every rank of the group makes the same calls in
/// the same order (each call is a collective: it returns once every rank has made it).
pub trait Communicator<B: Device>: Send + Sync {
    fn rank(&self) -> usize;
    fn ranks(&self) -> usize;
    /// The elementwise sum of every rank's `x` (one shape on every rank), on every rank.
    fn all_reduce_sum(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>>;
    /// Every rank's `x` `[rows, cols_r]` side by side, in rank order: `[rows, sum of cols_r]` on
    /// every rank (the vocabulary-split LM head's logits).
    fn all_gather_cols(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>>;
    /// Ends the group: ranks waiting in a collective, and every later call, get an error. A rank
    /// that fails between collectives calls it, so that the others do not wait for it forever.
    fn abort(&self, why: &str);
}

/// Ranks that are threads of one process: each collective reads every rank's tensor back to the
/// host (f32), combines them in rank order and uploads the result, so that it works on any backend
/// and gives the same bits whatever order the threads arrive in.
pub struct HostComm {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    ranks: usize,
    round: Mutex<Round>,
    done: Condvar,
}

/// The collective in progress: what each rank brought, and the result of the last one finished.
struct Round {
    op: Option<Op>,
    parts: Vec<Option<Part>>,
    /// Counts finished collectives: a waiter is done when it moves on.
    generation: u64,
    result: Arc<Vec<f32>>,
    aborted: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Sum,
    GatherCols,
}

struct Part {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl HostComm {
    /// The `ranks` ends of a new group, in rank order: hand one to each rank's thread.
    pub fn group(ranks: usize) -> Result<Vec<HostComm>> {
        if ranks == 0 {
            return Err(Error::input("a communicator group needs at least one rank"));
        }
        let round = Round {
            op: None,
            parts: (0..ranks).map(|_| None).collect(),
            generation: 0,
            result: Arc::default(),
            aborted: None,
        };
        let shared = Arc::new(Shared { ranks, round: Mutex::new(round), done: Condvar::new() });
        Ok((0..ranks).map(|rank| HostComm { rank, shared: shared.clone() }).collect())
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked holding the lock left a consistent round (every change is one
        // assignment); the others see its abort or time out with it.
        self.shared.round.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings this rank's part of collective `op`; the last rank to arrive combines all parts.
    fn exchange(&self, op: Op, part: Part) -> Result<Arc<Vec<f32>>> {
        let mut r = self.lock();
        if let Some(why) = &r.aborted {
            return Err(aborted(why));
        }
        if r.op.is_some_and(|o| o != op) {
            let why = format!("rank {} called {op:?} while other ranks called {:?}", self.rank, r.op);
            r.aborted = Some(why.clone());
            self.shared.done.notify_all();
            return Err(aborted(&why));
        }
        r.op = Some(op);
        r.parts[self.rank] = Some(part);
        let generation = r.generation;
        if r.parts.iter().all(Option::is_some) {
            let parts: Vec<Part> = r.parts.iter_mut().filter_map(Option::take).collect();
            match combine(op, &parts) {
                Ok(v) => r.result = Arc::new(v),
                Err(e) => r.aborted = Some(e.to_string()),
            }
            r.op = None;
            r.generation += 1;
            self.shared.done.notify_all();
            return match &r.aborted {
                Some(why) => Err(aborted(why)),
                None => Ok(r.result.clone()),
            };
        }
        let r = self
            .shared
            .done
            .wait_while(r, |r| r.generation == generation && r.aborted.is_none())
            .unwrap_or_else(|e| e.into_inner());
        match &r.aborted {
            Some(why) => Err(aborted(why)),
            None => Ok(r.result.clone()),
        }
    }
}

fn aborted(why: &str) -> Error {
    Error::input(format!("the rank group was aborted: {why}"))
}

/// The collective's result from every rank's part, in rank order.
fn combine(op: Op, parts: &[Part]) -> Result<Vec<f32>> {
    let first = &parts[0];
    match op {
        Op::Sum => {
            if let Some(p) = parts.iter().find(|p| p.shape != first.shape) {
                return Err(Error::input(format!("all_reduce_sum of shapes {:?} and {:?}", first.shape, p.shape)));
            }
            let mut sum = first.data.clone();
            for p in &parts[1..] {
                sum.iter_mut().zip(&p.data).for_each(|(s, v)| *s += v);
            }
            Ok(sum)
        }
        Op::GatherCols => {
            let rows = first.shape.first().copied().unwrap_or(0);
            if let Some(p) = parts.iter().find(|p| p.shape.len() != 2 || p.shape[0] != rows) {
                return Err(Error::input(format!("all_gather_cols of shapes {:?} and {:?}", first.shape, p.shape)));
            }
            let width: usize = parts.iter().map(|p| p.shape[1]).sum();
            let mut out = Vec::with_capacity(rows * width);
            for row in 0..rows {
                for p in parts {
                    let c = p.shape[1];
                    out.extend_from_slice(&p.data[row * c..(row + 1) * c]);
                }
            }
            Ok(out)
        }
    }
}

impl<B: Device> Communicator<B> for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.shared.ranks
    }

    fn all_reduce_sum(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
        let sum = self.exchange(Op::Sum, Part { shape: x.shape().to_vec(), data: b.to_f32(x)? })?;
        b.from_f32(x.shape(), &sum)
    }

    fn all_gather_cols(&self, b: &B, x: &Tensor<B>) -> Result<Tensor<B>> {
        let rows = x.rows();
        let all = self.exchange(Op::GatherCols, Part { shape: vec![rows, x.last_dim()], data: b.to_f32(x)? })?;
        b.from_f32(&[rows, all.len().checked_div(rows).unwrap_or(0)], &all)
    }

    fn abort(&self, why: &str) {
        let mut r = self.lock();
        if r.aborted.is_none() {
            r.aborted = Some(format!("rank {}: {why}", self.rank));
        }
        self.shared.done.notify_all();
    }
}
