//! The device context: adapter and device selection, the compute pipelines (compiled on first
//! use, per context), and the one command encoder every op records into.
//!
//! Ordering. Every write to memory a tensor owns goes through the pending encoder (uploads are a
//! copy from a fresh staging buffer, zeroing is `clear_buffer`, ops are compute passes), so the
//! device runs them in the order the host issued them, whatever the allocator hands out again.
//! `queue.write_buffer` is never used: it would run before commands recorded earlier.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use vt_core::{Error, Result};

use crate::shaders::{self, Kernel};

/// Commands recorded before the encoder is submitted without being asked (bounds what a long
/// run of ops with no read-back keeps alive).
const FLUSH_EVERY: usize = 256;

/// Loop iterations one invocation of a dispatch may take, counted as the kernels' loops run (a
/// loop's body runs plus one exit test): llvmpipe, and so lavapipe, silently ends every loop of
/// an invocation once 65535 iterations of all its loops together have run
/// (`LP_MAX_TGSI_LOOP_ITERATIONS`, a count shared between every loop of a shader). Kernels whose
/// loops grow with the input (the gated delta rule's over tokens and chunks, attention's over
/// keys) split their work into dispatches that stay under this, on every adapter: one path, the
/// one CI runs.
pub(crate) const LOOP_BUDGET: usize = 60_000;

/// Source of each device's range of buffer addresses (memory.rs), so that addresses are unique
/// in the process, as host and CUDA device addresses are; nothing is keyed by them globally.
static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);

/// Addresses a device's buffers take (1 TiB; the first page stays unused, as a null would).
const DEVICE_ADDRESSES: u32 = 40;

pub(crate) fn err(reason: impl Into<String>) -> Error {
    Error::backend("wgpu", reason)
}

struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    ops: usize,
}

/// One adapter's device and queue, and what is compiled for it.
pub struct Gpu {
    pub(crate) device: wgpu::Device,
    queue: wgpu::Queue,
    pub(crate) info: wgpu::AdapterInfo,
    pub(crate) limits: wgpu::Limits,
    pipelines: Vec<OnceLock<wgpu::ComputePipeline>>,
    pending: Mutex<Pending>,
    /// The next unused buffer address.
    next_addr: AtomicU64,
}

/// A storage range an op binds: a buffer, where in it, how many bytes.
#[derive(Clone, Copy)]
pub(crate) struct Range<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

impl Gpu {
    /// The adapter `VT_WGPU_ADAPTER` names (a substring of its name, case-insensitive), else the
    /// first hardware GPU, else whatever adapter there is (lavapipe on a machine without a GPU).
    pub fn new() -> Result<Arc<Gpu>> {
        Self::with_limits(|limits| limits)
    }

    /// As `new`, with the device's limits what `limits` makes of the adapter's (lower ones run
    /// as a smaller adapter would: tests of the paths such an adapter takes).
    pub fn with_limits(limits: impl FnOnce(wgpu::Limits) -> wgpu::Limits) -> Result<Arc<Gpu>> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        let wanted = std::env::var("VT_WGPU_ADAPTER").ok().map(|s| s.to_lowercase());
        let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        };
        let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        let adapter = match &wanted {
            Some(w) => adapters.into_iter().find(|a| a.get_info().name.to_lowercase().contains(w)),
            None => adapters.into_iter().min_by_key(rank),
        }
        .ok_or_else(|| match &wanted {
            Some(w) => err(format!("no adapter named like VT_WGPU_ADAPTER={w:?} among {names:?}")),
            None => err("no wgpu adapter (install a Vulkan driver: Mesa's lavapipe runs on the CPU)"),
        })?;
        let limits = limits(adapter.limits());
        shaders::check_limits(&limits).map_err(|e| err(format!("adapter {}: {e}", adapter.get_info().name)))?;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("vt"),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| err(format!("requesting the device: {e}")))?;
        Ok(Arc::new(Gpu {
            device,
            queue,
            info: adapter.get_info(),
            limits,
            pipelines: (0..Kernel::COUNT).map(|_| OnceLock::new()).collect(),
            pending: Mutex::new(Pending { encoder: None, ops: 0 }),
            next_addr: AtomicU64::new((NEXT_DEVICE.fetch_add(1, Ordering::Relaxed) << DEVICE_ADDRESSES) + 4096),
        }))
    }

    /// `size` bytes of this device's address space, never handed out again.
    pub(crate) fn addresses(&self, size: usize) -> u64 {
        self.next_addr.fetch_add(size as u64, Ordering::Relaxed)
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records with the pending encoder (made if there is none).
    pub(crate) fn record<R>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> R) -> R {
        let mut p = self.pending();
        let enc = p
            .encoder
            .get_or_insert_with(|| self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default()));
        let r = f(enc);
        p.ops += 1;
        if p.ops >= FLUSH_EVERY {
            Self::submit(&self.queue, &mut p);
        }
        r
    }

    fn submit(queue: &wgpu::Queue, p: &mut Pending) {
        if let Some(enc) = p.encoder.take() {
            queue.submit([enc.finish()]);
        }
        p.ops = 0;
    }

    /// Submits what is recorded.
    pub(crate) fn flush(&self) {
        Self::submit(&self.queue, &mut self.pending());
    }

    fn pipeline(&self, k: Kernel) -> &wgpu::ComputePipeline {
        self.pipelines[k as usize].get_or_init(|| {
            let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(k.name()),
                source: wgpu::ShaderSource::Wgsl(k.source().into()),
            });
            self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(k.name()),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            })
        })
    }

    /// The buffer `desc` describes, or an error where the adapter has no memory for it: without a
    /// scope, wgpu hands that to its default error handler, which panics, and a model or a batch
    /// too large for the adapter is an error to report instead.
    pub(crate) fn create_buffer(&self, desc: &wgpu::BufferDescriptor<'_>) -> Result<wgpu::Buffer> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(desc);
        match pollster::block_on(scope.pop()) {
            None => Ok(buffer),
            Some(e) => Err(err(format!("a buffer of {} bytes: the adapter is out of memory ({e})", desc.size))),
        }
    }

    /// A fresh buffer holding `bytes` (zero-padded to 4 bytes) for `usage`.
    pub(crate) fn init_buffer(&self, bytes: &[u8], usage: wgpu::BufferUsages) -> Result<wgpu::Buffer> {
        let mut padded;
        let contents = if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
            bytes
        } else {
            padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
            &padded
        };
        // Not wgpu's `create_buffer_init`, which panics where the buffer could not be made.
        let size = contents.len() as u64;
        let buffer =
            self.create_buffer(&wgpu::BufferDescriptor { label: None, size, usage, mapped_at_creation: true })?;
        buffer
            .get_mapped_range_mut(..)
            .map_err(|e| err(format!("filling a buffer of {size} bytes: {e}")))?
            .copy_from_slice(contents);
        buffer.unmap();
        Ok(buffer)
    }

    /// Copies `bytes` into `dst` in command order.
    pub(crate) fn write(&self, dst: Range<'_>, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let staging = self.init_buffer(bytes, wgpu::BufferUsages::COPY_SRC)?;
        let size = (bytes.len() as u64).next_multiple_of(4).min(dst.size);
        self.record(|e| e.copy_buffer_to_buffer(&staging, 0, dst.buffer, dst.offset, size));
        Ok(())
    }

    /// Runs `kernel` with `params` at binding 0 and `bindings` (binding number, range) over
    /// `groups` workgroups.
    ///
    /// The params are a read-only storage buffer, not a uniform one: lavapipe (Mesa 22.3) folds a
    /// uniform read in a loop's bounds into the shader and compiles it again for every dispatch,
    /// with JIT memory that is never given back (about 90 KB a dispatch). Each kernel copies them
    /// into a private `p` first, so the compiler may keep its loop bounds in registers (no write
    /// to a storage buffer can change a private value).
    pub(crate) fn dispatch(
        &self,
        kernel: Kernel,
        params: &[u32],
        bindings: &[(u32, Range<'_>)],
        groups: [u32; 3],
    ) -> Result<()> {
        let max = self.limits.max_storage_buffer_binding_size;
        if let Some((_, r)) = bindings.iter().find(|(_, r)| r.size > max) {
            return Err(err(format!(
                "{}: a tensor of {} bytes exceeds the adapter's storage binding limit of {max}",
                kernel.name(),
                r.size
            )));
        }
        let align = self.limits.min_storage_buffer_offset_alignment as u64;
        if let Some((_, r)) = bindings.iter().find(|(_, r)| !r.offset.is_multiple_of(align)) {
            return Err(err(format!(
                "{}: a tensor at byte {} of its buffer (a stacked expert's matrix, read only through \
                 its layer's table) is not bindable: the adapter binds at multiples of {align}",
                kernel.name(),
                r.offset
            )));
        }
        let pipeline = self.pipeline(kernel);
        let params = self.init_buffer(bytemuck::cast_slice(params), wgpu::BufferUsages::STORAGE)?;
        let mut entries = vec![wgpu::BindGroupEntry { binding: 0, resource: params.as_entire_binding() }];
        entries.extend(bindings.iter().map(|&(binding, r)| wgpu::BindGroupEntry {
            binding,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: r.buffer,
                offset: r.offset,
                size: wgpu::BufferSize::new(r.size),
            }),
        }));
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kernel.name()),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        self.record(|e| {
            let mut pass = e.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(kernel.name()),
                timestamp_writes: None,
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        });
        Ok(())
    }

    /// Workgroups for `n` items of `per` each, spread over x and y within the dispatch limit.
    pub(crate) fn grid(&self, n: usize, per: usize) -> Result<[u32; 3]> {
        let groups = n.div_ceil(per).max(1);
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        let y = groups.div_ceil(max);
        if y > max {
            return Err(err(format!("{n} items exceed one dispatch")));
        }
        Ok([groups.div_ceil(y) as u32, y as u32, 1])
    }

    /// Checks a per-axis workgroup count.
    pub(crate) fn axis(&self, n: usize, what: &str) -> Result<u32> {
        if n > self.limits.max_compute_workgroups_per_dimension as usize {
            return Err(err(format!("{what}: {n} workgroups exceed the adapter's dispatch limit")));
        }
        Ok(n.max(1) as u32)
    }

    /// The bytes of `src`, after everything recorded so far has run.
    pub(crate) fn read(&self, src: Range<'_>, len: usize) -> Result<Vec<u8>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let size = (len as u64).next_multiple_of(4);
        let staging = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read-back"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })?;
        {
            let mut p = self.pending();
            let mut enc = p
                .encoder
                .take()
                .unwrap_or_else(|| self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default()));
            enc.copy_buffer_to_buffer(src.buffer, src.offset, &staging, 0, size);
            self.queue.submit([enc.finish()]);
            p.ops = 0;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| err(format!("waiting for the device: {e}")))?;
        rx.recv()
            .map_err(|_| err("read-back never completed"))?
            .map_err(|e| err(format!("mapping the read-back buffer: {e}")))?;
        let view = staging.get_mapped_range(..).map_err(|e| err(format!("reading the read-back buffer: {e}")))?;
        Ok(view[..len].to_vec())
    }

    /// Waits for everything recorded so far.
    pub fn synchronize(&self) -> Result<()> {
        self.flush();
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| err(format!("waiting for the device: {e}")))?;
        Ok(())
    }

    /// The adapter, as `vt` reports it: name, driver, backend.
    pub fn describe(&self) -> String {
        format!("{} ({}, {:?})", self.info.name, self.info.driver, self.info.backend)
    }
}
