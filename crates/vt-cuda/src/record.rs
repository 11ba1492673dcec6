//! Recorded decode steps: a decode step's ~500 kernel launches captured once as a CUDA graph and
//! replayed with one launch per step, so the host no longer paces the GPU.
//!
//! A recorder is a `CudaBackend` whose ops go to a capture stream of their own (other threads keep
//! using the backend's stream meanwhile) and whose memory comes from an arena of the parent's
//! blocks (`alloc::for_recording`), reserved for the recording's lifetime. What changes from
//! step to step is read from device memory that `replay` fills before the launch: the token ids
//! (embedding), the position (rope, the attention kernels, the KV append) and the block tables.
//! Everything else a recording touches is fixed: weights, the sequence's recurrent states, which it
//! updates in place, and the KV pool's layers, whose storage never moves (`replay` checks that the
//! pool it is given is the one recorded).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaGraph, CudaStream};
use vt_core::backend::check as args;
use vt_core::backend::prelude::*;
use vt_core::{KvSeq, Result};

use crate::capture::Recording;
use crate::device::CudaBackend;
use crate::error::{driver_err, err};
use crate::kv::CudaKvPool;
use crate::launch::i32_of;
use crate::limits::KV_BLOCK;

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

/// Queues `g` for `ids` at `pos` over `seqs` of `pool` after checking that they are the pool
/// layers it recorded, in its order, with tables its buffers have room for. `Ok(false)`: it no
/// longer fits (another pool's layers, a table outgrew the recording, or tables it recorded as one
/// now differ), nothing was queued.
pub(crate) fn replay(
    b: &CudaBackend,
    g: &mut CudaStepGraph,
    ids: &[u32],
    pos: usize,
    pool: &CudaKvPool,
    seqs: &[KvSeq<'_>],
) -> Result<bool> {
    let op = "replay";
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
    let recorded = rec.attention.lock().unwrap_or_else(|p| p.into_inner());
    let (calls, tables) = (&recorded.calls, &recorded.tables);
    if seqs.len() != calls.len() {
        return Err(err(format!("replay: {} pool layers for a step recorded over {}", seqs.len(), calls.len())));
    }
    for seq in seqs {
        if seq.start != pos {
            return Err(err(format!("replay at position {pos}: a sequence's layer {} is at {}", seq.layer, seq.start)));
        }
    }
    let used = (pos + 1).div_ceil(KV_BLOCK);
    for (seq, call) in seqs.iter().zip(calls) {
        let store = pool.layer(op, seq)?;
        // Another pool (or layer) than the one the step writes into: record again over it.
        if seq.layer != call.layer || store.keys() != call.keys || store.layout != call.layout {
            return Ok(false);
        }
        // The kernels write and read through the table: every id they use must be the layer's.
        args::kv_table(b, op, seq, 1, KV_BLOCK, store.layout.blocks, call.window)?;
    }
    if used > rec.table_width() {
        return Ok(false);
    }
    // Each table buffer's first call gives its contents; the others must agree.
    let mut filled: Vec<Option<&[u32]>> = vec![None; tables.len()];
    for (seq, call) in seqs.iter().zip(calls) {
        let t = &seq.table[..used];
        match filled[call.table] {
            Some(first) if first != t => return Ok(false),
            Some(_) => {}
            None => filled[call.table] = Some(t),
        }
    }
    let mut host = Vec::with_capacity(1 + ids.len());
    host.push(i32_of(pos, "position")? as u32);
    host.extend_from_slice(ids);
    b.copy_in(&rec.inputs, &host)?;
    for ((buf, _), t) in tables.iter().zip(&filled) {
        b.copy_in(buf, t.expect("every table buffer has a call"))?;
    }
    drop(recorded);
    // SAFETY: the graph is alive (owned by `g`) and runs on the backend's stream after the inputs
    // copies. Every address recorded in it is alive: its arena, inputs and tables are held by `g`,
    // weights and recurrent states by the caller's model and sequence (which own `g`), and the KV
    // pool's layers are the recorded storage (checked above), whose blocks the tables name
    // (kv_table) for positions up to `pos`, within the recorded grids (table_width).
    unsafe { result::graph::launch(g.graph.cu_graph_exec(), b.stream().cu_stream()) }
        .map_err(|e| driver_err("launching a recorded step", e))?;
    Ok(true)
}
