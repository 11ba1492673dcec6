//! Recorded decode steps: a decode step's ~500 kernel launches captured once as a CUDA graph and
//! replayed with one launch per step, so the host no longer paces the GPU.
//!
//! A recorder is a `CudaBackend` whose ops go to a capture stream of their own (other threads keep
//! using the backend's stream meanwhile) and whose memory comes from an arena of the parent's
//! blocks (`alloc::for_recording`), reserved for the recording's lifetime. What changes from
//! step to step is read from device memory that `replay` fills before the launch: the token ids
//! (embedding) and the position (rope, the attention kernels, the KV append). Everything else a
//! recording touches is fixed: weights, the sequence's recurrent states, which it updates in place,
//! and its rows of the KV pool, which the recording checks at every replay (`RecordedCache`).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaGraph, CudaStream};
use vt_core::backend::prelude::*;
use vt_core::{KvSeq, Result};

use crate::capture::Recording;
use crate::device::CudaBackend;
use crate::error::{driver_err, err};
use crate::kv::{CudaKvPool, Rows};
use crate::launch::i32_of;

/// A recorded decode step, ready to replay on the backend it was recorded from.
pub struct CudaStepGraph {
    graph: CudaGraph,
    /// The recorder: its inputs, its arena (the recorded step's scratch) and what it recorded.
    recorder: CudaBackend,
    main: Arc<CudaStream>,
}

// SAFETY: cudarc's `CudaGraph` is not `Send` because graph objects must not be used from two
// threads at once. A `CudaStepGraph` uses its graph only in `replay` (through `&mut self`) and in
// drop, so moving it to another thread cannot make two threads use the graph together.
unsafe impl Send for CudaStepGraph {}

impl Drop for CudaStepGraph {
    fn drop(&mut self) {
        // Replays may still be queued: let them finish before the graph and its arena go.
        let _ = self.main.synchronize();
    }
}

impl CudaStepGraph {
    fn recording(&self) -> &Recording {
        self.recorder.recording().expect("a step graph's recorder is recording")
    }
}

/// Ends `recorder`'s capture and instantiates what it recorded.
pub(crate) fn finish(parent: &CudaBackend, recorder: CudaBackend) -> Result<CudaStepGraph> {
    let rec = recorder.recording().ok_or_else(|| err("finish_recording: this backend is not a recorder"))?;
    if recorder.instance_id() != parent.instance_id() {
        return Err(err("finish_recording: the recorder belongs to another backend"));
    }
    let graph = rec
        .stream()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| driver_err("ending a capture", e))?
        .ok_or_else(|| err("finish_recording: nothing was recorded"))?;
    Ok(CudaStepGraph { graph, main: parent.stream().clone(), recorder })
}

/// Queues `g` for `ids` at `pos` after checking that `seqs`' rows in `pool` start where it
/// recorded them, with room for this position. `Ok(false)`: it no longer fits (a table names other
/// blocks, or is full), nothing was queued.
pub(crate) fn replay(
    b: &CudaBackend,
    g: &mut CudaStepGraph,
    ids: &[u32],
    pos: usize,
    pool: &mut CudaKvPool,
    seqs: &[KvSeq<'_>],
) -> Result<bool> {
    if !Arc::ptr_eq(&g.main, b.stream()) {
        return Err(err("replay: the step was recorded on another backend"));
    }
    let rec = g.recording();
    if ids.len() != rec.ids {
        return Err(err(format!("replay: {} ids for a step recorded for {}", ids.len(), rec.ids)));
    }
    let vocab = rec.vocab.lock().unwrap_or_else(|p| p.into_inner()).unwrap_or(0);
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(err(format!("replay: token id {bad} is outside the recorded vocabulary of {vocab}")));
    }
    let recorded = rec.caches.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if seqs.len() != recorded.len() {
        return Err(err(format!("replay: {} layers for a step recorded over {}", seqs.len(), recorded.len())));
    }
    if seqs.iter().any(|s| s.start != pos) {
        return Err(err(format!("replay at position {pos}: a layer's sequence is at another position")));
    }
    for (s, r) in seqs.iter().zip(&recorded) {
        // The recorded rows must start where the table's do and hold this position, within the
        // table's own consecutive blocks (the step writes row `pos`; the splits past it read
        // nothing).
        let now = Rows::in_place(pool, s, 1).and_then(|rows| rows.recorded());
        if !now.is_some_and(|c| c.keys == r.keys && pos < c.capacity.min(r.capacity)) {
            return Ok(false);
        }
    }
    let mut host = Vec::with_capacity(1 + ids.len());
    host.push(i32_of(pos, "position")? as u32);
    host.extend_from_slice(ids);
    b.copy_in(&rec.inputs, &host)?;
    // SAFETY: the graph is alive (owned by `g`) and runs on the backend's stream after the inputs
    // copy. Every address recorded in it is alive: its arena and inputs are held by `g`, weights
    // and recurrent states by the caller's model and sequence (which own `g`), and the pool rows
    // are the recorded ones, in blocks the sequence's tables hold, with room for this position
    // (checked above).
    unsafe { result::graph::launch(g.graph.cu_graph_exec(), b.stream().cu_stream()) }
        .map_err(|e| driver_err("launching a recorded step", e))?;
    Ok(true)
}
