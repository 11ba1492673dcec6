//! What a recorder is recording (record.rs): its capture stream, the inputs its replays write
//! (position and token ids) and the KV caches the step appends to.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaStream};
use vt_core::Result;

use crate::alloc::CudaBuffer;
use crate::error::{driver_err, err};

/// A KV cache as a recorded step uses it: the storage its kernels were given, and how many
/// positions that storage holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordedCache {
    pub keys: u64,
    pub capacity: usize,
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
    /// The attention layers' caches, in the order the step appends to them.
    pub(crate) caches: Mutex<Vec<RecordedCache>>,
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
        Ok(Recording { stream, inputs, pos, ids, vocab: Mutex::new(None), caches: Mutex::new(Vec::new()) })
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

    pub(crate) fn add_cache(&self, cache: RecordedCache) {
        self.caches.lock().unwrap_or_else(|p| p.into_inner()).push(cache);
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
