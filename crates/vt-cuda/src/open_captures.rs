//! The captures open in this process, and the cuBLASLt handles whose destruction waits for them.
//!
//! `cublasLtDestroy` synchronises the device, and that invalidates every capture open on it, in
//! any thread and capture mode. Of the driver and cuBLASLt calls a backend makes when it is built,
//! used or dropped, only it did (the rest: module loads and unloads, allocations and frees, stream
//! creation and destruction, synchronous copies, graph instantiation and launch; measured on the
//! H200 with tools/gpu/capture_probe.c, docs/architecture.md "The invariant"). So a backend dropped
//! in one thread made another thread's step recording fail. Here a handle dropped while a capture
//! is open is destroyed when the last open capture closes, and no capture begins while one is
//! destroyed.
//!
//! This is vt-cuda's one piece of process-wide state: a count and the handles waiting, nothing
//! derived from weights.

use std::sync::{Mutex, MutexGuard};

use cudarc::cublaslt::{result as lt, sys};

/// A cuBLASLt handle waiting to be destroyed.
struct Handle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle is not tied to the thread that made it; once its owner has dropped it,
// only `destroy` below uses it, once, under the lock.
unsafe impl Send for Handle {}

struct Open {
    captures: usize,
    waiting: Vec<Handle>,
}

static OPEN: Mutex<Open> = Mutex::new(Open { captures: 0, waiting: Vec::new() });

fn open() -> MutexGuard<'static, Open> {
    OPEN.lock().unwrap_or_else(|p| p.into_inner())
}

fn destroy(handle: Handle) {
    // SAFETY: the handle's owner dropped it (`destroy_handle`) and it is destroyed once. A failure
    // has no one to report to.
    let _ = unsafe { lt::destroy_handle(handle.0) };
}

/// Taken before a capture begins and dropped once it has ended: while any is held, cuBLASLt handles
/// wait to be destroyed.
pub(crate) struct CaptureOpen(());

impl CaptureOpen {
    pub(crate) fn new() -> Self {
        open().captures += 1;
        CaptureOpen(())
    }
}

impl Drop for CaptureOpen {
    fn drop(&mut self) {
        let mut open = open();
        open.captures -= 1;
        if open.captures == 0 {
            open.waiting.drain(..).for_each(destroy);
        }
    }
}

/// Destroys `handle` now if no capture is open, else once the last one closes.
///
/// # Safety
/// `handle` came from `cublasLtCreate`, is given here once, and is not used afterwards.
pub(crate) unsafe fn destroy_handle(handle: sys::cublasLtHandle_t) {
    let mut open = open();
    if open.captures == 0 {
        destroy(Handle(handle));
    } else {
        open.waiting.push(Handle(handle));
    }
}
