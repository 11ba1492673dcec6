//! The kernels of `kernels/*.cu`, compiled by NVRTC for the device's architecture when a backend
//! starts. Each file is compiled as `common.cuh` + the file, its `#include "NAME.cuh"` lines
//! replaced by those headers (the binary carries the sources: NVRTC has no include path at run
//! time), with the options below; CI runs the same compile step without a GPU (this module's
//! test), and tools/gpu/check_kernels.py mirrors it for quick checks and tools/gpu/kernel_sass.py.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use rayon::prelude::*;
use vt_core::{Error, Result};

use crate::error::driver_err;
use crate::limits::DEFINES;

const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// The headers a kernel file may `#include`, by name.
const HEADERS: &[(&str, &str)] = &[
    ("route.cuh", include_str!("../../../kernels/route.cuh")),
    ("weight_chunks.cuh", include_str!("../../../kernels/weight_chunks.cuh")),
    ("kv_blocks.cuh", include_str!("../../../kernels/kv_blocks.cuh")),
    ("nvfp4.cuh", include_str!("../../../kernels/nvfp4.cuh")),
];

/// What NVRTC compiles for `file`: `common.cuh`, then `src` with each `#include "NAME"` line
/// replaced by header NAME.
fn source(file: &str, src: &str) -> Result<String> {
    let mut out = String::with_capacity(COMMON.len() + src.len());
    out.push_str(COMMON);
    for line in src.lines() {
        match line.strip_prefix("#include \"").and_then(|l| l.strip_suffix('"')) {
            Some(name) => {
                let (_, header) = HEADERS.iter().find(|(h, _)| *h == name).ok_or_else(|| {
                    Error::backend(
                        "cuda",
                        format!("kernels/{file} includes {name}, which is not one of vt-cuda's headers"),
                    )
                })?;
                out.push('\n');
                out.push_str(header);
            }
            None => {
                out.push('\n');
                out.push_str(line);
            }
        }
    }
    Ok(out)
}

/// NVRTC's options for `arch`: the language, and limits.rs's numbers as defines.
fn options(arch: &str) -> Vec<String> {
    // Keep in step with tools/gpu/check_kernels.py (`OPTIONS`, `defines`).
    let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()];
    o.extend(DEFINES.iter().map(|(name, value)| format!("-D{name}={value}")));
    o
}

/// PTX of every `(file, source)`, in order, compiled for `arch` side by side (NVRTC is CPU work and
/// the files are independent: a backend starts in about the time of the slowest file,
/// gdn_chunk.cu).
fn compile_all(arch: &str, sources: &[(&str, &str)]) -> Result<Vec<Ptx>> {
    sources
        .par_iter()
        .map(|&(file, src)| {
            let opts = CompileOptions { options: options(arch), name: Some(file.into()), ..Default::default() };
            compile_ptx_with_opts(source(file, src)?, opts)
                .map_err(|e| Error::backend("cuda", format!("kernels/{file} does not compile: {e:?}")))
        })
        .collect()
}

fn load(ctx: &Arc<CudaContext>, file: &str, ptx: Ptx) -> Result<Arc<CudaModule>> {
    ctx.load_module(ptx).map_err(|e| driver_err(&format!("loading kernels/{file}"), e))
}

macro_rules! kernels {
    ($($file:literal => [$($name:ident),* $(,)?]),* $(,)?) => {
        /// Each file's name and source.
        const SOURCES: &[(&str, &str)] = &[$(($file, include_str!(concat!("../../../kernels/", $file)))),*];
        /// The kernels each file of `SOURCES` defines.
        #[cfg(test)]
        const NAMES: &[&[&str]] = &[$(&[$(stringify!($name)),*]),*];

        /// Every kernel function, by its `extern "C"` name.
        pub struct Kernels {
            $($(pub $name: CudaFunction,)*)*
            /// Streaming multiprocessors of the device: sizes the one-wave grids.
            pub sm_count: usize,
            /// Shared memory a block may opt in to (bytes): kernels that need more are not taken.
            pub max_shared: usize,
        }

        impl Kernels {
            pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
                let (major, minor) = ctx.compute_capability().map_err(|e| driver_err("compute capability", e))?;
                let arch = format!("sm_{major}{minor}");
                // One PTX per file, in the order of `SOURCES`.
                let mut ptx = compile_all(&arch, SOURCES)?.into_iter();
                $(
                    let module = load(ctx, $file, ptx.next().expect("one PTX per file"))?;
                    $(let $name = module.load_function(stringify!($name)).map_err(|e| driver_err(concat!("kernel ", stringify!($name)), e))?;)*
                )*
                let sm_count = ctx
                    .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .map_err(|e| driver_err("multiprocessor count", e))? as usize;
                let max_shared = ctx
                    .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                    .map_err(|e| driver_err("shared memory per block", e))? as usize;
                Ok(Kernels { $($($name,)*)* sm_count, max_shared })
            }
        }
    };
}

kernels! {
    "elementwise.cu" => [embedding, add, swiglu, gate, narrow_cols],
    "rope.cu" => [rope, rope_seqs],
    "argmax.cu" => [argmax_part, argmax_rows],
    "logprobs.cu" => [top_logprobs],
    "linear.cu" => [linear_rows],
    "attention.cu" => [kv_append, attention],
    "gdn.cu" => [causal_conv1d, gdn_recurrent],
    "moe.cu" => [moe_route, moe_gate_up, moe_down, moe_combine],
    "gemv.cu" => [gemv_bf16, gemv_bf16_t1, gemv_bf16_mma1, gemv_bf16_mma2, gemv_bf16_mma1_t16, gemv_bf16_mma2_t16, gemv_nvfp4, gemv_nvfp4_t16],
    "moe_decode.cu" => [moe_dec_route, moe_dec_gate_up_bf16, moe_dec_gate_up_nvfp4, moe_dec_down_bf16, moe_dec_down_nvfp4],
    "gdn_decode.cu" => [gdn_dec_conv, gdn_dec_state],
    "random.cu" => [fill_random],
    "timing.cu" => [spin],
    "attn_decode.cu" => [attn_dec_split_h1, attn_dec_split_h4, attn_dec_mma_d64, attn_dec_mma_d128, attn_dec_mma_d256, attn_dec_combine],
    "norm.cu" => [rms_norm, add_rms_norm, rms_norm_gated],
    "moe_prefill.cu" => [moe_prefill_route, moe_prefill_plan, moe_prefill_scatter, moe_gemm_gate_up, moe_gemm_down, moe_prefill_combine],
    "flash_attn.cu" => [flash_attn_d64, flash_attn_d128, flash_attn_d256],
    "gdn_chunk.cu" => [gdn_chunk_prep_v64, gdn_chunk_scan_v64, gdn_chunk_prep_v128, gdn_chunk_scan_v128],
    "w4a16.cu" => [nvfp4_repack, w4a16_gemm, moe_w4_gate_up, moe_w4_down],
}

/// Lets `f` use `bytes` of dynamic shared memory (above the 48 KiB a launch gets by default).
pub(crate) fn allow_shared(f: &CudaFunction, bytes: usize, name: &str) -> Result<()> {
    f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
        .map_err(|e| driver_err(&format!("{name}: {bytes} bytes of shared memory"), e))
}

/// `static_assert`s, for a kernel file, that the C struct of the same name as Rust's `#[repr(C)]`
/// twin has its size and field offsets (`__INTADDR__`: NVRTC's front end has no offsetof).
#[cfg(test)]
macro_rules! c_layout {
    ($ty:ident { $($field:ident),* $(,)? }) => {{
        let name = stringify!($ty);
        let mut checks = vec![format!("static_assert(sizeof({name}) == {});", std::mem::size_of::<$ty>())];
        $(checks.push(format!(
            "static_assert(__INTADDR__(&(({name}*)0)->{}) == {});",
            stringify!($field),
            std::mem::offset_of!($ty, $field)
        ));)*
        checks
    }};
}
#[cfg(test)]
pub(crate) use c_layout;

/// A `static_assert` that the C expression `expr` is `value` (a size both sides compute).
#[cfg(test)]
pub(crate) fn c_equal(expr: &str, value: usize) -> String {
    format!("static_assert(({expr}) == {value});")
}

#[cfg(test)]
mod tests {
    use super::{compile_all, options, source, CompileOptions, NAMES, SOURCES};

    /// Needs libnvrtc on the library path (no GPU): the files compile side by side and each PTX
    /// lands with its own file.
    #[test]
    fn every_file_compiles_to_its_own_ptx() {
        let ptx = compile_all("sm_90", SOURCES).unwrap();
        assert_eq!(ptx.len(), SOURCES.len());
        for ((ptx, (file, _)), names) in ptx.iter().zip(SOURCES).zip(NAMES) {
            let text = ptx.to_src();
            for name in *names {
                assert!(text.contains(&format!(".entry {name}(")), "{file}: no kernel {name} in its PTX");
            }
        }
    }

    /// What a kernel file and this crate both state agrees: NVRTC (front end only) checks each
    /// file's `static_assert`s on the sizes and layouts the Rust side computes.
    #[test]
    fn the_kernels_mirror_this_crates_layouts_and_sizes() {
        let mirrors = [
            ("gemv.cu", [crate::weight::mirrors(), crate::ops::linear::gemv::mirrors()].concat()),
            ("moe_decode.cu", [crate::ops::moe::routing_mirrors(), crate::ops::moe::decode_mirrors()].concat()),
            ("moe_prefill.cu", crate::ops::moe::routing_mirrors()),
            ("attn_decode.cu", crate::ops::attention::decode::mirrors()),
            ("gdn_chunk.cu", crate::ops::gdn::chunk::mirrors()),
            ("w4a16.cu", [crate::w4a16::mirrors(), crate::nvfp4::mirrors()].concat()),
        ];
        for (file, checks) in mirrors {
            let (_, src) = SOURCES.iter().find(|(f, _)| *f == file).unwrap();
            let text = format!("{}\n{}\n", source(file, src).unwrap(), checks.join("\n"));
            let mut options = options("sm_90");
            options.push("-fdevice-syntax-only".into());
            let opts = CompileOptions { options, name: Some(file.into()), ..Default::default() };
            if let Err(e) = cudarc::nvrtc::compile_ptx_with_opts(text, opts) {
                panic!("{file} disagrees with vt-cuda: {e:?}");
            }
        }
    }
}
