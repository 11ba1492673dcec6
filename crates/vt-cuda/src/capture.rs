//! What a recorder is recording (record.rs): its capture stream, the inputs its replays write
//! (position, token ids and block tables) and the pool layers the step attends over.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaStream};
use vt_core::{KvLayout, KvSeq, Result};

use crate::alloc::CudaBuffer;
use crate::error::{driver_err, err};
use crate::kv::KvStore;
use crate::limits::KV_BLOCK;

/// Positions past the one recorded that its replays may reach: the block tables the step reads
/// have room for them, and its attention grids cover them.
pub(crate) const RECORD_AHEAD: usize = 256;

/// One attention call of a recorded step: the pool layer it reads (its storage, which a replay's
/// pool must still have) and which of the recording's table buffers holds its block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordedAttention {
    pub layer: usize,
    pub keys: u64,
    pub layout: KvLayout,
    pub window: Option<usize>,
    pub table: usize,
}

/// A recording's attention calls and the table buffers they read.
#[derive(Default)]
pub(crate) struct RecordedTables {
    /// The calls, in the order the step makes them.
    pub calls: Vec<RecordedAttention>,
    /// A buffer of `table_width()` entries per distinct table (layers that share a table share
    /// its buffer), with the table it was recorded with.
    pub tables: Vec<(CudaBuffer, Vec<u32>)>,
}

/// What a recorder is recording.
pub(crate) struct Recording {
    stream: Arc<CudaStream>,
    /// `[position: i32, ids: u32 x ids]`, filled by each replay before its launch.
    pub(crate) inputs: CudaBuffer,
    pos: usize,
    /// Token ids a step takes.
    pub(crate) ids: usize,
    /// Set by the recorded embedding: ids a replay may pass are below it.
    pub(crate) vocab: Mutex<Option<usize>>,
    pub(crate) attention: Mutex<RecordedTables>,
}

impl Recording {
    /// Starts capturing on a new stream of `parent`'s context; `inputs` (4 * (1 + ids) bytes, of
    /// the backend whose stream is `parent`: replays write them there) is where the step reads
    /// its position and ids.
    pub(crate) fn begin(parent: &Arc<CudaStream>, inputs: CudaBuffer, ids: usize, pos: usize) -> Result<Self> {
        let stream = parent.context().new_stream().map_err(|e| driver_err("creating a capture stream", e))?;
        // Relaxed: the arena may take a chunk from the parent while the capture is open.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| driver_err("beginning a capture", e))?;
        Ok(Recording {
            stream,
            inputs,
            pos,
            ids,
            vocab: Mutex::new(None),
            attention: Mutex::new(RecordedTables::default()),
        })
    }

    /// The capture stream.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Device address of the step's position (an `i32`).
    pub(crate) fn pos_at(&self, op: &str, pos: usize) -> Result<u64> {
        if pos != self.pos {
            return Err(err(format!("{op}: position {pos} in a step recorded at position {}", self.pos)));
        }
        Ok(self.inputs.ptr())
    }

    /// Device address of the step's token ids, for a table of `vocab` rows.
    pub(crate) fn ids_at(&self, ids: usize, vocab: usize) -> Result<u64> {
        if ids != self.ids {
            return Err(err(format!("embedding: {ids} ids in a step recorded for {}", self.ids)));
        }
        *self.vocab.lock().unwrap_or_else(|p| p.into_inner()) = Some(vocab);
        Ok(self.inputs.ptr() + 4)
    }

    /// Entries of every recorded block table: room for the positions up to `RECORD_AHEAD` past
    /// the recorded one.
    pub(crate) fn table_width(&self) -> usize {
        (self.pos + 1 + RECORD_AHEAD).div_ceil(KV_BLOCK)
    }

    /// Records an attention call over `seq` in `store` (at the recorded position) and returns the
    /// device address of the table buffer its kernels read, which replays fill; `alloc` makes a
    /// buffer of the recording's memory.
    pub(crate) fn table_at(
        &self,
        op: &str,
        seq: &KvSeq<'_>,
        store: &KvStore,
        window: Option<usize>,
        alloc: impl FnOnce(usize) -> Result<CudaBuffer>,
    ) -> Result<u64> {
        self.pos_at(op, seq.start)?;
        let used = &seq.table[..(seq.start + 1).div_ceil(KV_BLOCK)];
        let mut rec = self.attention.lock().unwrap_or_else(|p| p.into_inner());
        let table = match rec.tables.iter().position(|(_, t)| t == used) {
            Some(i) => i,
            None => {
                rec.tables.push((alloc(4 * self.table_width())?, used.to_vec()));
                rec.tables.len() - 1
            }
        };
        rec.calls.push(RecordedAttention { layer: seq.layer, keys: store.keys(), layout: store.layout, window, table });
        Ok(rec.tables[table].0.ptr())
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        // A recording abandoned half way (an op failed) still holds its capture open.
        if let Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE) = self.stream.capture_status() {
            // SAFETY: the stream is capturing (checked); ending the capture hands back its graph,
            // which nothing else holds and which is destroyed at once.
            if let Ok(graph) = unsafe { result::stream::end_capture(self.stream.cu_stream()) } {
                if !graph.is_null() {
                    // SAFETY: `graph` came from the capture just ended and is destroyed once.
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
        }
    }
}
