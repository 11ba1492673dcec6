//! The captures open in this process, and when a cuBLASLt handle may be destroyed.
//!
//! `cublasLtDestroy` synchronises the device, and that invalidates every capture open on it, in
//! any thread and capture mode. Of the driver and cuBLASLt calls a backend makes when it is built,
//! used or dropped, only it did (the rest: module loads and unloads, allocations and frees, stream
//! creation and destruction, synchronous copies, graph instantiation and launch; measured on the
//! H200 with tools/gpu/capture_probe.c, docs/architecture.md "The invariant"). So a backend dropped
//! in one thread made another thread's step recording fail, and that step shape ran unrecorded
//! from then on. Here a handle is destroyed only while no capture is open, and no capture begins
//! while one is being destroyed; a handle dropped while captures are open is destroyed by a thread
//! of its own once they have closed, so the drop never waits on a capture.
//!
//! The state is one atomic word, the open captures' count and a flag while a handle is destroyed:
//! keyed by nothing, holding nothing derived from weights.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::CudaContext;

/// Set in `STATE` while a handle is being destroyed.
const DESTROYING: usize = 1 << (usize::BITS - 1);

/// Open captures, plus `DESTROYING`.
static STATE: AtomicUsize = AtomicUsize::new(0);

/// Held from before a capture begins until it has ended.
pub(crate) struct CaptureOpen(());

impl CaptureOpen {
    /// Waits while a handle is being destroyed (a device synchronisation), then counts one more
    /// open capture.
    pub(crate) fn new() -> Self {
        loop {
            let s = STATE.load(Ordering::Acquire);
            if s & DESTROYING == 0 && STATE.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                return CaptureOpen(());
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for CaptureOpen {
    fn drop(&mut self) {
        STATE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs `f` with `DESTROYING` set if no capture is open now; `false` (nothing ran) otherwise.
fn alone(f: &mut Option<impl FnOnce()>) -> bool {
    if STATE.compare_exchange(0, DESTROYING, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return false;
    }
    // Only DESTROYING was set, and captures neither begin nor end while it is: clearing it
    // restores 0, also if `f` panics (captures would otherwise wait forever).
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            STATE.store(0, Ordering::Release);
        }
    }
    let _clear = Clear;
    if let Some(f) = f.take() {
        f();
    }
    true
}

/// Runs `f` while no capture is open and none can begin: now, or on a thread of its own once the
/// open ones have closed.
fn when_no_capture_is_open(f: impl FnOnce() + Send + 'static) {
    let mut f = Some(f);
    if alone(&mut f) {
        return;
    }
    // Where no thread can be made, `f` is dropped unrun (a handle leaks rather than a capture
    // failing).
    let _ = std::thread::Builder::new().name("vt-cuda-destroy".into()).spawn(move || {
        let mut wait = Duration::from_micros(50);
        while !alone(&mut f) {
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(2));
        }
    });
}

/// A cuBLASLt handle given up, and its context, for the thread that destroys it.
struct Handle(sys::cublasLtHandle_t, Arc<CudaContext>);

// SAFETY: a cuBLASLt handle is not tied to the thread that made it; once its owner has given it up
// (`destroy_handle`), only `Handle::destroy` uses it, once.
unsafe impl Send for Handle {}

impl Handle {
    fn destroy(self) {
        // The destroy synchronises the device through the CUDA runtime, which takes the thread's
        // current context (a thread of its own has none, or another device's); held here, the
        // context outlives its last backend until then. A failure means the context is gone.
        if self.1.bind_to_thread().is_ok() {
            // SAFETY: `destroy_handle`'s contract; a failure has no one to report to.
            let _ = unsafe { lt::destroy_handle(self.0) };
        }
    }
}

/// Destroys `handle` (made in `ctx`) while no capture is open: now, or once the open ones have
/// closed.
///
/// # Safety
/// `handle` came from `cublasLtCreate`, is given here once, and is not used afterwards.
pub(crate) unsafe fn destroy_handle(handle: sys::cublasLtHandle_t, ctx: Arc<CudaContext>) {
    let handle = Handle(handle, ctx);
    when_no_capture_is_open(move || handle.destroy());
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::{when_no_capture_is_open, CaptureOpen};

    const LONG: Duration = Duration::from_secs(10);
    const SHORT: Duration = Duration::from_millis(200);

    /// One test, so that nothing else in this binary opens captures meanwhile (the state is the
    /// process's).
    #[test]
    fn destruction_waits_for_open_captures_and_captures_for_destruction() {
        // No capture open: it runs before the call returns.
        let (tx, rx) = mpsc::channel();
        when_no_capture_is_open(move || tx.send(()).unwrap());
        assert_eq!(rx.try_recv(), Ok(()), "it ran at once");

        // Two captures open: it waits for both, and the call does not wait.
        let (a, b) = (CaptureOpen::new(), CaptureOpen::new());
        let (tx, rx) = mpsc::channel();
        when_no_capture_is_open(move || tx.send(()).unwrap());
        drop(a);
        assert!(rx.recv_timeout(SHORT).is_err(), "it ran with a capture open");
        drop(b);
        assert_eq!(rx.recv_timeout(LONG), Ok(()), "it ran once the captures closed");

        // A capture begun during a destruction begins once it has ended.
        let (tx, rx) = mpsc::channel();
        when_no_capture_is_open(move || {
            let (began_tx, began) = mpsc::channel();
            let opener = std::thread::spawn(move || {
                let open = CaptureOpen::new();
                began_tx.send(()).unwrap();
                open
            });
            let early = began.recv_timeout(SHORT).is_ok();
            tx.send((early, began, opener)).unwrap();
        });
        let (early, began, opener) = rx.recv_timeout(LONG).expect("it ran at once");
        assert!(!early, "a capture began during a destruction");
        assert_eq!(began.recv_timeout(LONG), Ok(()), "the capture began after it");
        drop(opener.join().unwrap());
    }
}
