//! The WGSL kernels (shaders/*.wgsl), each compiled with the shared parts it uses: common.wgsl
//! (scalar math), weights.wgsl (decoding a weight in its stored form) and gdn_layout.wgsl (the
//! chunked gated delta rule's scratch).

use wgpu::naga;

const COMMON: &str = include_str!("shaders/common.wgsl");
const WEIGHTS: &str = include_str!("shaders/weights.wgsl");
const GDN_LAYOUT: &str = include_str!("shaders/gdn_layout.wgsl");

macro_rules! kernels {
    ($($name:ident = $file:literal uses [$($part:ident),*];)*) => {
        /// Every kernel, by the file it is written in.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Kernel { $($name),* }

        impl Kernel {
            pub const ALL: &'static [Kernel] = &[$(Kernel::$name),*];
            pub const COUNT: usize = Self::ALL.len();

            pub fn name(self) -> &'static str {
                match self { $(Kernel::$name => $file),* }
            }

            /// The kernel's WGSL with the shared parts it uses.
            pub fn source(self) -> String {
                match self {
                    $(Kernel::$name => [COMMON, $($part,)* include_str!(concat!("shaders/", $file))].concat()),*
                }
            }
        }
    };
}

kernels! {
    Convert = "convert.wgsl" uses [WEIGHTS];
    Embedding = "embedding.wgsl" uses [WEIGHTS];
    Linear = "linear.wgsl" uses [WEIGHTS];
    RmsNorm = "rms_norm.wgsl" uses [];
    Elementwise = "elementwise.wgsl" uses [];
    Narrow = "narrow.wgsl" uses [];
    Rope = "rope.wgsl" uses [];
    Conv = "conv.wgsl" uses [];
    GdnGates = "gdn_gates.wgsl" uses [];
    Gdn = "gdn.wgsl" uses [];
    GdnChunk = "gdn_chunk.wgsl" uses [GDN_LAYOUT];
    GdnState = "gdn_state.wgsl" uses [GDN_LAYOUT];
    Attention = "attention.wgsl" uses [];
    Route = "route.wgsl" uses [];
    Argmax = "argmax.wgsl" uses [WEIGHTS];
}

impl Kernel {
    /// The kernel as wgpu compiles it (naga's module of its WGSL).
    fn module(self) -> Result<naga::Module, String> {
        let source = self.source();
        naga::front::wgsl::parse_str(&source).map_err(|e| format!("{}: {}", self.name(), e.emit_to_string(&source)))
    }

    /// What the kernel asks of the adapter: (limit, the kernel's need, the adapter's `limits`).
    fn needs(self, limits: &wgpu::Limits) -> Result<[(&'static str, u32, u32); 7], String> {
        let module = self.module()?;
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).map_err(|e| format!("{}: {e}", self.name()))?;
        let globals = || module.global_variables.iter().map(|(_, g)| g);
        let storage = globals().filter(|g| matches!(g.space, naga::AddressSpace::Storage { .. })).count() as u32;
        let bindings = globals().filter_map(|g| g.binding.as_ref()).map(|b| b.binding + 1).max().unwrap_or(0);
        let shared = globals().filter(|g| g.space == naga::AddressSpace::WorkGroup).map(|g| layouter[g.ty].size).sum();
        let [x, y, z] = module.entry_points.iter().map(|e| e.workgroup_size).next().unwrap_or([1; 3]);
        let l = limits;
        Ok([
            ("max_storage_buffers_per_shader_stage", storage, l.max_storage_buffers_per_shader_stage),
            ("max_bindings_per_bind_group", bindings, l.max_bindings_per_bind_group),
            ("max_compute_workgroup_storage_size", shared, l.max_compute_workgroup_storage_size),
            ("max_compute_invocations_per_workgroup", x * y * z, l.max_compute_invocations_per_workgroup),
            ("max_compute_workgroup_size_x", x, l.max_compute_workgroup_size_x),
            ("max_compute_workgroup_size_y", y, l.max_compute_workgroup_size_y),
            ("max_compute_workgroup_size_z", z, l.max_compute_workgroup_size_z),
        ])
    }
}

/// An error naming the first of `limits` that a kernel needs more of: an adapter too small for
/// vt's kernels is refused when its device is made, not at a kernel's first dispatch (where wgpu
/// would report the invalid pipeline through its error handler, which panics).
pub(crate) fn check_limits(limits: &wgpu::Limits) -> Result<(), String> {
    for &k in Kernel::ALL {
        if let Some((limit, need, has)) = k.needs(limits)?.into_iter().find(|(_, need, has)| need > has) {
            return Err(format!("kernel {} needs {limit} >= {need}; the adapter's is {has}", k.name()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_limits, naga, Kernel};

    fn parse(k: Kernel) -> naga::Module {
        k.module().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every kernel parses and validates (naga, as wgpu compiles it), without a device.
    #[test]
    fn every_kernel_validates() {
        for &k in Kernel::ALL {
            naga::valid::Validator::new(Default::default(), naga::valid::Capabilities::all())
                .validate(&parse(k))
                .unwrap_or_else(|e| panic!("{}: {e:?}", k.name()));
        }
    }

    /// Params come in a read-only storage buffer at binding 0 and nothing is a uniform
    /// (`Gpu::dispatch` says what a uniform costs on lavapipe).
    #[test]
    fn every_kernel_reads_its_params_from_storage() {
        for &k in Kernel::ALL {
            let module = parse(k);
            let globals: Vec<_> = module.global_variables.iter().map(|(_, g)| g).collect();
            assert!(globals.iter().all(|g| g.space != naga::AddressSpace::Uniform), "{}: a uniform buffer", k.name());
            let params = globals.iter().find(|g| g.binding.as_ref().is_some_and(|b| b.group == 0 && b.binding == 0));
            assert!(
                params.is_some_and(|g| g.space == naga::AddressSpace::Storage { access: naga::StorageAccess::LOAD }),
                "{}: binding 0 is not a read-only storage buffer",
                k.name()
            );
        }
    }

    /// vt's kernels fit WebGPU's default limits, which every adapter wgpu offers meets, and a
    /// smaller set of limits is refused by name (the downlevel set binds 4 storage buffers).
    #[test]
    fn the_kernels_fit_webgpu_limits_and_a_smaller_adapter_is_named() {
        assert_eq!(check_limits(&wgpu::Limits::default()), Ok(()));
        let small = check_limits(&wgpu::Limits::downlevel_defaults()).unwrap_err();
        assert!(small.contains("max_storage_buffers_per_shader_stage >= "), "{small}");
        let shared = wgpu::Limits { max_compute_workgroup_storage_size: 64, ..Default::default() };
        let small = check_limits(&shared).unwrap_err();
        assert!(small.contains("needs max_compute_workgroup_storage_size >= "), "{small}");
    }
}
