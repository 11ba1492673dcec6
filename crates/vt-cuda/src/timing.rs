//! Device-side timing for benchmarks: CUDA events on a backend's own stream, so a figure is the
//! GPU time of the work an op queues, not the host's.

use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::PushKernelArg;
use vt_core::Result;

use crate::device::CudaBackend;
use crate::error::driver_err;
use crate::launch::{grid1, launched};

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

/// Time per call of a queued piece of work.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTime {
    /// Device time per call (µs), between CUDA events around the calls.
    pub device_us: f64,
    /// Host time per call to queue the work (µs).
    pub host_us: f64,
}

impl CudaBackend {
    /// Runs `f(0..iters)` queued behind a `spin_ms` busy-wait on the stream, so the device executes
    /// the calls back to back while the host is still queueing them: `device_us` is then what the
    /// kernels take, not the launch overhead (`host_us` says whether the spin was long enough).
    pub fn time_queued(
        &self,
        iters: usize,
        spin_ms: f64,
        mut f: impl FnMut(usize) -> Result<()>,
    ) -> Result<DeviceTime> {
        let ev = |what: &str| {
            self.stream()
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| driver_err(&format!("event for {what}"), e))
        };
        let (start, end) = (ev("start")?, ev("end")?);
        let ns = (spin_ms * 1e6) as i64;
        let mut l = self.stream().launch_builder(&self.k().spin);
        l.arg(&ns);
        // SAFETY: spin(long long ns): one thread reading the global timer, no memory access.
        launched(unsafe { l.launch(grid1(1)) }, "spin")?;
        start.record(self.stream()).map_err(|e| driver_err("recording an event", e))?;
        let t0 = Instant::now();
        for i in 0..iters {
            f(i)?;
        }
        let host = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        end.record(self.stream()).map_err(|e| driver_err("recording an event", e))?;
        end.synchronize().map_err(|e| driver_err("waiting for an event", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver_err("event time", e))?;
        Ok(DeviceTime { device_us: ms as f64 * 1e3 / iters as f64, host_us: host })
    }
}
