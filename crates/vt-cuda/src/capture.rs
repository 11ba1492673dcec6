//! What a recorder is recording (record.rs): its capture stream, the inputs its replays write
//! (positions, token ids, block tables and delta-net state addresses) and what the step holds
//! fixed (the pool layers it attends over, states the composed ops address directly).

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaGraph, CudaStream};
use vt_core::{KvLayout, KvSeq, Result};

use crate::alloc::{Allocator, CudaBuffer};
use crate::error::{driver_err, err};
use crate::kv::KvStore;
use crate::limits::KV_BLOCK;
use crate::open_captures::CaptureOpen;

/// Positions past the ones recorded that its replays may reach: the block tables the step reads
/// have room for them, and its attention grids cover them.
pub(crate) const RECORD_AHEAD: usize = 256;

/// One attention call of a recorded step: the rows it serves (`rows` from `row`: a decode step's
/// all, a verification's wave some), the pool layer it reads (its storage, which a replay's pool
/// must still have) and which of the recording's table buffers holds its rows' tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordedAttention {
    pub row: usize,
    pub rows: usize,
    pub layer: usize,
    pub keys: u64,
    pub layout: KvLayout,
    pub window: Option<usize>,
    pub table: usize,
}

/// One delta-net call of a recorded step: where its kernels read the states' addresses, or the
/// addresses its ops were recorded with (the composed ops take no address array).
pub(crate) enum RecordedStates {
    /// `[conv: n][recurrent: n][first conv: n][first recurrent: n]` addresses of the call's `n`
    /// states and where it writes them after their first position (0: nowhere), filled by each
    /// replay.
    Filled(CudaBuffer, usize),
    /// Those four addresses of each of the call's states: a replay must pass these.
    Fixed(Vec<[u64; 4]>),
}

impl RecordedStates {
    /// States the call takes.
    pub(crate) fn len(&self) -> usize {
        match self {
            RecordedStates::Filled(_, n) => *n,
            RecordedStates::Fixed(f) => f.len(),
        }
    }
}

/// A recording's calls and the buffers they read.
#[derive(Default)]
pub(crate) struct RecordedCalls {
    /// The attention calls, in the order the step makes them.
    pub attention: Vec<RecordedAttention>,
    /// A buffer of `rows x table_width()` entries per distinct set of tables (calls whose rows
    /// have the same tables share it), with the tables it was recorded with.
    pub tables: Vec<(CudaBuffer, Vec<Vec<u32>>)>,
    /// The delta-net calls, in order.
    pub delta_net: Vec<RecordedStates>,
}

/// What a recorder is recording.
pub(crate) struct Recording {
    stream: Arc<CudaStream>,
    /// The parent backend's memory, where the buffers replays fill live: never the recorder's
    /// arena, whose blocks the recorded ops share out as scratch (a table placed in a block that
    /// an earlier op of the step writes would be overwritten mid-replay).
    parent: Arc<Allocator>,
    /// `[positions: i32 x rows, ids: u32 x rows]`, filled by each replay before its launch.
    pub(crate) inputs: CudaBuffer,
    /// The positions recorded, a row each.
    positions: Vec<usize>,
    /// Set by the recorded embedding: ids a replay may pass are below it.
    pub(crate) vocab: Mutex<Option<usize>>,
    pub(crate) calls: Mutex<RecordedCalls>,
    /// Held from before the capture begins until it ends (`end`, or drop).
    open: Mutex<Option<CaptureOpen>>,
}

impl Recording {
    /// Starts capturing on a new stream of the context of `parent` (the recording backend's
    /// memory, on its stream, where replays fill the step's inputs) for a step of one token for
    /// each of `positions.len()` sequences at those positions.
    pub(crate) fn begin(parent: &Arc<Allocator>, positions: &[usize]) -> Result<Self> {
        if positions.is_empty() {
            return Err(err("recorder: a step of no sequences"));
        }
        let inputs = CudaBuffer::new(parent, 8 * positions.len())?;
        let stream =
            parent.raw().stream().context().new_stream().map_err(|e| driver_err("creating a capture stream", e))?;
        let open = CaptureOpen::new();
        // Relaxed: the arena may take a chunk from the parent while the capture is open.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| driver_err("beginning a capture", e))?;
        Ok(Recording {
            stream,
            parent: parent.clone(),
            inputs,
            positions: positions.to_vec(),
            vocab: Mutex::new(None),
            calls: Mutex::new(RecordedCalls::default()),
            open: Mutex::new(Some(open)),
        })
    }

    /// Ends the capture: the graph of what was recorded, `None` where nothing was.
    pub(crate) fn end(&self) -> Result<Option<CudaGraph>> {
        let graph =
            self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| driver_err("ending a capture", e));
        self.open.lock().unwrap_or_else(|p| p.into_inner()).take();
        graph
    }

    /// The capture stream.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Sequences (rows) the step takes.
    pub(crate) fn rows(&self) -> usize {
        self.positions.len()
    }

    /// Device address of the position (an `i32`) of the one row at `pos`.
    pub(crate) fn pos_at(&self, op: &str, pos: usize) -> Result<u64> {
        self.positions_at(op, &[pos])
    }

    /// Device address of the positions (`i32`s) of the rows an op serves, given as theirs.
    pub(crate) fn positions_at(&self, op: &str, starts: &[usize]) -> Result<u64> {
        Ok(self.inputs.ptr() + 4 * self.row_of(op, starts)? as u64)
    }

    /// The first of the consecutive rows whose recorded positions are `starts`: all rows for a
    /// decode step's ops, a wave's for a verification's (its positions follow one another, so
    /// they name their rows). Positions that match no run of rows, or several, are refused.
    fn row_of(&self, op: &str, starts: &[usize]) -> Result<usize> {
        let mut at = (0..=self.positions.len().saturating_sub(starts.len()))
            .filter(|&r| !starts.is_empty() && self.positions[r..r + starts.len()] == *starts);
        match (at.next(), at.next()) {
            (Some(row), None) => Ok(row),
            (first, _) => Err(err(format!(
                "{op}: positions {starts:?} match {} rows of a step recorded at {:?}",
                if first.is_some() { "several runs of" } else { "no run of" },
                self.positions
            ))),
        }
    }

    /// Device address of the step's token ids, for a table of `vocab` rows.
    pub(crate) fn ids_at(&self, ids: usize, vocab: usize) -> Result<u64> {
        if ids != self.rows() {
            return Err(err(format!("embedding: {ids} ids in a step recorded for {}", self.rows())));
        }
        *self.vocab.lock().unwrap_or_else(|p| p.into_inner()) = Some(vocab);
        Ok(self.inputs.ptr() + 4 * self.rows() as u64)
    }

    /// Entries of every recorded block table: room for the positions up to `RECORD_AHEAD` past
    /// the furthest recorded one.
    pub(crate) fn table_width(&self) -> usize {
        let last = self.positions.iter().copied().max().unwrap_or(0);
        (last + 1 + RECORD_AHEAD).div_ceil(KV_BLOCK)
    }

    /// Records an attention call over the rows' `seqs` in `store` (at the recorded positions) and
    /// returns the device address of the table buffer its kernels read (`rows x table_width()`
    /// entries), which replays fill.
    pub(crate) fn table_at(&self, op: &str, seqs: &[KvSeq<'_>], store: &KvStore, window: Option<usize>) -> Result<u64> {
        let starts: Vec<usize> = seqs.iter().map(|s| s.start).collect();
        let row = self.row_of(op, &starts)?;
        let used: Vec<Vec<u32>> = seqs.iter().map(|s| s.table[..(s.start + 1).div_ceil(KV_BLOCK)].to_vec()).collect();
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let table = match calls.tables.iter().position(|(_, t)| *t == used) {
            Some(i) => i,
            None => {
                let buf = CudaBuffer::new(&self.parent, 4 * seqs.len() * self.table_width())?;
                calls.tables.push((buf, used));
                calls.tables.len() - 1
            }
        };
        let layer = seqs.first().map_or(0, |s| s.layer);
        calls.attention.push(RecordedAttention {
            row,
            rows: seqs.len(),
            layer,
            keys: store.keys(),
            layout: store.layout,
            window,
            table,
        });
        Ok(calls.tables[table].0.ptr())
    }

    /// Records a delta-net call of `n` states (a row's each) whose kernels read their addresses
    /// from device memory and returns where: `[conv: n][recurrent: n][first conv: n][first
    /// recurrent: n]` `u64`s (`RecordedStates::Filled`), which replays fill.
    pub(crate) fn states_at(&self, op: &str, n: usize) -> Result<u64> {
        self.check_states(op, n)?;
        let buf = CudaBuffer::new(&self.parent, 32 * n)?;
        let ptr = buf.ptr();
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).delta_net.push(RecordedStates::Filled(buf, n));
        Ok(ptr)
    }

    /// Records a delta-net call whose ops address its states directly (`RecordedStates::Fixed`).
    pub(crate) fn fixed_states(&self, op: &str, states: Vec<[u64; 4]>) -> Result<()> {
        self.check_states(op, states.len())?;
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).delta_net.push(RecordedStates::Fixed(states));
        Ok(())
    }

    fn check_states(&self, op: &str, n: usize) -> Result<()> {
        if n == 0 || n > self.rows() {
            return Err(err(format!("{op}: {n} sequences in a step recorded for {}", self.rows())));
        }
        Ok(())
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        // A recording abandoned half way (an op failed) still holds its capture open; an
        // invalidated capture must be ended too before its stream is used or destroyed.
        use sys::CUstreamCaptureStatus::{CU_STREAM_CAPTURE_STATUS_ACTIVE, CU_STREAM_CAPTURE_STATUS_INVALIDATED};
        if let Ok(CU_STREAM_CAPTURE_STATUS_ACTIVE | CU_STREAM_CAPTURE_STATUS_INVALIDATED) = self.stream.capture_status()
        {
            // SAFETY: the stream is capturing (checked); ending the capture hands back its graph
            // (none where it was invalidated), which nothing else holds and which is destroyed at
            // once.
            if let Ok(graph) = unsafe { result::stream::end_capture(self.stream.cu_stream()) } {
                if !graph.is_null() {
                    // SAFETY: `graph` came from the capture just ended and is destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
        }
    }
}
