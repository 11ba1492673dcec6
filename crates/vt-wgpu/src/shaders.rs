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

    /// Every kernel parses and validates (naga, as wgpu compiles it), without a device.
    #[test]
    fn every_kernel_validates() {
        for &k in Kernel::ALL {
            let module = wgpu::naga::front::wgsl::parse_str(&k.source())
                .unwrap_or_else(|e| panic!("{}: {}", k.name(), e.emit_to_string(&k.source())));
            wgpu::naga::valid::Validator::new(Default::default(), wgpu::naga::valid::Capabilities::all())
                .validate(&module)
                .unwrap_or_else(|e| panic!("{}: {e:?}", k.name()));
        }
    }
}
