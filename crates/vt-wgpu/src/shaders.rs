//! The WGSL kernels (shaders/*.wgsl), each compiled with the shared parts it uses: common.wgsl
//! (scalar math), weights.wgsl (decoding a weight in its stored form) and gdn_layout.wgsl (the
//! chunked gated delta rule's scratch).

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

#[cfg(test)]
mod tests {
    use super::Kernel;
    use wgpu::naga;

    fn parse(k: Kernel) -> naga::Module {
        naga::front::wgsl::parse_str(&k.source())
            .unwrap_or_else(|e| panic!("{}: {}", k.name(), e.emit_to_string(&k.source())))
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
}
