//! Recorded decode steps: a decode step's ~500 kernel launches captured once as a CUDA graph and
//! replayed with one launch per step, so the host no longer paces the GPU.
//!
//! A recorder is a `CudaBackend` whose ops go to a capture stream of their own (other threads keep
//! using the backend's stream meanwhile) and whose memory comes from an arena of the parent's
//! blocks (`alloc::for_recording`), reserved for the recording's lifetime. What changes from
//! step to step is read from device memory that `replay` fills before the launch: the token ids
//! (embedding), the positions (rope, the attention kernels, the KV append), the block tables and
//! the addresses of the delta-net states the fused decode kernels update (these live in the
//! parent's memory, never in the arena the recorded ops share out as scratch). Everything else a
//! recording touches is fixed: weights, the states the composed delta-net ops address directly
//! (`replay` refuses other ones), and the KV pool's layers, whose storage never moves (`replay`
//! checks that the pool it is given is the one recorded).

use std::sync::Arc;

use cudarc::driver::{result, CudaGraph, CudaStream};
use vt_core::backend::check as args;
use vt_core::backend::prelude::*;
use vt_core::{KvSeq, ReplayInputs, Result, RELEASED};

use crate::alloc::CudaBuffer;
use crate::capture::{RecordedAttention, RecordedStates, Recording};
use crate::device::{CudaBackend, CudaTensor};
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
    /// What the last replay wrote into each table buffer and each delta-net call's address buffer
    /// (nothing else writes them): a replay copies only the ones that changed. A batch-1 step
    /// otherwise paid one host-to-device copy per delta-net layer before its launch.
    uploaded_tables: Vec<Vec<u32>>,
    uploaded_states: Vec<Vec<u64>>,
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

fn recording_of(recorder: &CudaBackend) -> &Recording {
    recorder.recording().expect("a step graph's recorder is recording")
}

/// Copies `host` into `buf` unless `last` (what the previous copy wrote there) equals it.
fn upload_changed<T: Copy + PartialEq>(
    b: &CudaBackend,
    buf: &CudaBuffer,
    host: Vec<T>,
    last: &mut Vec<T>,
) -> Result<()> {
    if *last != host {
        b.copy_in(buf, &host)?;
        *last = host;
    }
    Ok(())
}

/// Ends `recorder`'s capture and instantiates what it recorded.
pub(crate) fn finish(parent: &CudaBackend, recorder: CudaBackend) -> Result<CudaStepGraph> {
    let rec = recorder.recording().ok_or_else(|| err("finish_recording: this backend is not a recorder"))?;
    if recorder.instance_id() != parent.instance_id() {
        return Err(err("finish_recording: the recorder belongs to another backend"));
    }
    let graph = rec.end()?.ok_or_else(|| err("finish_recording: nothing was recorded"))?;
    Ok(CudaStepGraph {
        graph,
        main: parent.stream().clone(),
        recorder,
        uploaded_tables: Vec::new(),
        uploaded_states: Vec::new(),
    })
}

/// Each recorded attention call with the sequences a replay gives it: the replay gives one call
/// per layer, which the recording made as one call or, where an op runs a call per row (the
/// composed `attention_decode`), as one per row, in order.
fn given_calls<'a, 'b>(
    given: &'a [Vec<KvSeq<'a>>],
    calls: &'b [RecordedAttention],
) -> Result<Vec<(&'a [KvSeq<'a>], &'b RecordedAttention)>> {
    let mismatch = || {
        err(format!(
            "replay: attention calls of {:?} rows for a step recorded with calls of {:?}",
            given.iter().map(Vec::len).collect::<Vec<_>>(),
            calls.iter().map(|c| c.rows).collect::<Vec<_>>()
        ))
    };
    let mut out = Vec::with_capacity(calls.len());
    let mut recorded = calls.iter();
    for seqs in given {
        let mut rest = seqs.as_slice();
        while !rest.is_empty() {
            let call = recorded.next().ok_or_else(mismatch)?;
            if call.rows > rest.len() {
                return Err(mismatch());
            }
            let (these, after) = rest.split_at(call.rows);
            out.push((these, call));
            rest = after;
        }
    }
    if recorded.next().is_some() {
        return Err(mismatch());
    }
    Ok(out)
}

/// Queues `g` for `inp` over `pool` after checking that its attention calls are over the pool
/// layers it recorded, in its order, with tables its buffers have room for, and its delta-net
/// calls over states it may address. `Ok(false)`: it no longer fits (another pool's layers, a
/// table outgrew the recording, tables it recorded as one now differ, or other states where the
/// recorded ops address them directly), nothing was queued.
pub(crate) fn replay(
    b: &CudaBackend,
    g: &mut CudaStepGraph,
    pool: &CudaKvPool,
    inp: &ReplayInputs<'_, CudaBackend>,
) -> Result<bool> {
    let op = "replay";
    if !Arc::ptr_eq(&g.main, b.stream()) {
        return Err(err("replay: the step was recorded on another backend"));
    }
    let rec = recording_of(&g.recorder);
    let rows = rec.rows();
    if inp.ids.len() != rows || inp.positions.len() != rows {
        return Err(err(format!(
            "replay: {} ids at {} positions for a step recorded for {rows} sequences",
            inp.ids.len(),
            inp.positions.len()
        )));
    }
    let vocab = rec.vocab.lock().unwrap_or_else(|p| p.into_inner()).unwrap_or(0);
    if let Some(&bad) = inp.ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(err(format!("replay: token id {bad} is outside the recorded vocabulary of {vocab}")));
    }
    let recorded = rec.calls.lock().unwrap_or_else(|p| p.into_inner());
    let tables = &recorded.tables;
    let attention = given_calls(&inp.attention, &recorded.attention)?;
    if inp.delta_net.len() != recorded.delta_net.len() {
        return Err(err(format!(
            "replay: {} delta-net calls for a step recorded with {}",
            inp.delta_net.len(),
            recorded.delta_net.len()
        )));
    }
    let width = rec.table_width();
    for &(seqs, call) in &attention {
        let positions = inp.positions.get(call.row..call.row + call.rows);
        if seqs.len() != call.rows || positions.is_none() {
            return Err(err(format!(
                "replay: an attention call of {} sequences for rows {}..{} of a step of {rows}",
                seqs.len(),
                call.row,
                call.row + call.rows
            )));
        }
        for (seq, &pos) in seqs.iter().zip(positions.into_iter().flatten()) {
            if seq.start != pos {
                return Err(err(format!(
                    "replay at position {pos}: a sequence's layer {} is at {}",
                    seq.layer, seq.start
                )));
            }
            let store = pool.layer(op, seq)?;
            // Another pool (or layer) than the one the step writes into: record again over it.
            if seq.layer != call.layer || store.keys() != call.keys || store.layout != call.layout {
                return Ok(false);
            }
            // The kernels write and read through the table: every id they use must be the layer's.
            args::kv_table(b, op, seq, 1, KV_BLOCK, store.layout.blocks, call.window)?;
            if (pos + 1).div_ceil(KV_BLOCK) > width {
                return Ok(false);
            }
        }
    }
    // Each table buffer holds, a row each, the longest table its calls read (a verification's
    // waves read one sequence's table to successive positions); the others must agree with it.
    let mut filled: Vec<Option<Vec<&[u32]>>> = vec![None; tables.len()];
    for &(seqs, call) in &attention {
        let used = seqs.iter().map(|s| &s.table[..(s.start + 1).div_ceil(KV_BLOCK)]);
        match &mut filled[call.table] {
            Some(rows) if rows.len() != seqs.len() => return Ok(false),
            Some(rows) => {
                for (have, new) in rows.iter_mut().zip(used) {
                    let common = have.len().min(new.len());
                    if have[..common] != new[..common] {
                        return Ok(false);
                    }
                    if new.len() > have.len() {
                        *have = new;
                    }
                }
            }
            None => filled[call.table] = Some(used.collect()),
        }
    }
    let mut states = Vec::with_capacity(recorded.delta_net.len());
    for (given, call) in inp.delta_net.iter().zip(&recorded.delta_net) {
        if given.len() != call.len() {
            return Err(err(format!(
                "replay: a delta-net call of {} sequences recorded with {}",
                given.len(),
                call.len()
            )));
        }
        let at = |t: &CudaTensor| t.buffer().ptr();
        let ptrs: Vec<[u64; 4]> = (given.iter())
            .map(|s| {
                let (fc, fr) = s.first.map_or((0, 0), |(c, r)| (at(c), at(r)));
                [at(s.conv), at(s.recurrent), fc, fr]
            })
            .collect();
        match call {
            RecordedStates::Filled(buf, _) => states.push((buf, ptrs)),
            RecordedStates::Fixed(fixed) if *fixed != ptrs => return Ok(false),
            RecordedStates::Fixed(_) => {}
        }
    }
    let mut host: Vec<u32> = Vec::with_capacity(2 * rows);
    for &pos in inp.positions {
        host.push(i32_of(pos, "position")? as u32);
    }
    host.extend_from_slice(inp.ids);
    b.copy_in(&rec.inputs, &host)?;
    g.uploaded_tables.resize_with(tables.len(), Vec::new);
    for (((buf, _), seqs), last) in tables.iter().zip(&filled).zip(&mut g.uploaded_tables) {
        let seqs = seqs.as_ref().ok_or_else(|| err("replay: a recorded table buffer no call reads"))?;
        let mut t = Vec::with_capacity(seqs.len() * width);
        for used in seqs {
            t.extend_from_slice(used);
            t.extend(std::iter::repeat_n(RELEASED, width - used.len()));
        }
        upload_changed(b, buf, t, last)?;
    }
    g.uploaded_states.resize_with(states.len(), Vec::new);
    for ((buf, ptrs), last) in states.into_iter().zip(&mut g.uploaded_states) {
        let addrs: Vec<u64> = (0..4).flat_map(|k| ptrs.iter().map(move |p| p[k])).collect();
        upload_changed(b, buf, addrs, last)?;
    }
    drop(recorded);
    // SAFETY: the graph is alive (owned by `g`) and runs on the backend's stream after the inputs
    // copies. Every address recorded in it is alive: its arena, inputs, tables and state address
    // buffers are held by `g`, weights by the caller's model, the states the caller passed (or
    // that the recording holds fixed, compared above) by the caller's pool, and the KV pool's
    // layers are the recorded storage (checked above), whose blocks the tables name (kv_table)
    // for positions up to each row's, within the recorded grids (width).
    unsafe { result::graph::launch(g.graph.cu_graph_exec(), b.stream().cu_stream()) }
        .map_err(|e| driver_err("launching a recorded step", e))?;
    Ok(true)
}
