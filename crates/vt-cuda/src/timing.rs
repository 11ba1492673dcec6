//! Device-side timing for benchmarks: CUDA events on a backend's own stream, so a figure is the
//! GPU time of the work an op queues, not the host's.

use cudarc::driver::sys::CUevent_flags;
use vt_core::Result;

use crate::alloc::driver_err;
use crate::CudaBackend;

impl CudaBackend {
    /// Median milliseconds of `iters` runs of `f` (each between two events), after `warmup` runs.
    /// Nothing waits until the last run is queued: a wait lets the stream-ordered pool hand freed
    /// memory back to the driver, and the next run would time its re-allocation.
    pub fn time_ms(&self, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f32> {
        for _ in 0..warmup {
            f()?;
        }
        let event =
            || self.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| driver_err("event", e));
        let mut marks = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            let start = event()?;
            f()?;
            marks.push((start, event()?));
        }
        let mut times = Vec::with_capacity(marks.len());
        for (start, stop) in &marks {
            times.push(start.elapsed_ms(stop).map_err(|e| driver_err("event timing", e))?);
        }
        times.sort_by(f32::total_cmp);
        Ok(times[times.len() / 2])
    }
}
