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

/// Limits.rs's numbers, each with its value in `defines` where that names it, else its value in
/// `base` (a kernel set's numbers, or limits.rs's own). A name that is not limits.rs's is an error.
fn numbers(defines: &[(&str, i64)], base: &[(&'static str, i64)]) -> Result<Vec<(&'static str, i64)>> {
    if let Some((name, _)) = defines.iter().find(|(n, _)| !base.iter().any(|(b, _)| b == n)) {
        return Err(Error::backend("cuda", format!("{name} is not one of the kernels' numbers (limits.rs)")));
    }
    Ok(base.iter().map(|&(n, v)| (n, defines.iter().find(|d| d.0 == n).map_or(v, |d| d.1))).collect())
}

/// NVRTC's options for `arch`: the language, and `numbers` (limits.rs's) as defines.
fn options(arch: &str, numbers: &[(&str, i64)]) -> Vec<String> {
    // Keep in step with tools/gpu/check_kernels.py (`OPTIONS`, `defines`).
    let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()];
    o.extend(numbers.iter().map(|(name, value)| format!("-D{name}={value}")));
    o
}

/// PTX of every `(file, source)`, in order, compiled for `arch` with `numbers` side by side (NVRTC
/// is CPU work and the files are independent: a backend starts in about the time of the slowest
/// file, gdn_chunk.cu).
fn compile_all(arch: &str, sources: &[(&str, &str)], numbers: &[(&str, i64)]) -> Result<Vec<Ptx>> {
    sources
        .par_iter()
        .map(|&(file, src)| {
            let opts =
                CompileOptions { options: options(arch, numbers), name: Some(file.into()), ..Default::default() };
            compile_ptx_with_opts(source(file, src)?, opts)
                .map_err(|e| Error::backend("cuda", format!("kernels/{file} does not compile: {e:?}")))
        })
        .collect()
}

/// Which of `sources` a kernel set made from another one with `defines` compiles again: those
/// whose source (headers included) uses one of the names.
fn to_compile(sources: &[(&str, &str)], defines: &[(&str, i64)]) -> Vec<bool> {
    sources
        .iter()
        .map(|&(file, src)| defines.iter().any(|(n, _)| source(file, src).is_ok_and(|s| s.contains(n))))
        .collect()
}

/// The launch shapes limits.rs states for the decode kernels whose launch code needs them, as a
/// kernel set was compiled with them (a bench's variant may change them:
/// `CudaBackend::with_kernel_defines`).
pub struct LaunchShapes {
    /// k tiles a GEMV warp has in flight, and most warps of a GEMV block.
    pub gemv_tiles: usize,
    pub gemv_max_warps: usize,
    /// Warps of a MoE gate/up block and of a MoE down block (one token's: `moe_down1_warps`).
    pub moe_warps: usize,
    pub moe_down_warps: usize,
    pub moe_down1_warps: usize,
    /// The bf16 MoE down kernel's threads a block and blocks a SM (its one resident wave), and
    /// its one-token instance's.
    pub moe_bf16_down_threads: usize,
    pub moe_bf16_down_wave: usize,
    pub moe_bf16_down1_threads: usize,
    pub moe_bf16_down1_wave: usize,
    /// Warps of a bf16 MoE gate/up block.
    pub moe_bf16_gate_up_warps: usize,
    /// Tokens from which a dense linear runs through a bf16 copy of its weight and cuBLASLt.
    pub dequant_from_t: usize,
}

impl LaunchShapes {
    fn of(numbers: &[(&str, i64)]) -> Self {
        let n = |name| numbers.iter().find(|d| d.0 == name).map_or(1, |d| d.1.max(1) as usize);
        LaunchShapes {
            gemv_tiles: n("GEMV_NV4_TILES"),
            gemv_max_warps: n("GEMV_NV4_MAX_WARPS"),
            moe_warps: n("MOE_NV4_WARPS"),
            moe_down_warps: n("MOE_NV4_DOWN_WARPS"),
            moe_down1_warps: n("MOE_NV4_DOWN1_WARPS"),
            moe_bf16_down_threads: n("MOE_DEC_THREADS"),
            moe_bf16_down_wave: n("MOE_DEC_WAVE_BF16"),
            moe_bf16_down1_threads: n("MOE_DEC_T1_THREADS"),
            moe_bf16_down1_wave: n("MOE_DEC_T1_WAVE_BF16"),
            moe_bf16_gate_up_warps: n("MOE_DEC_GU_WARPS"),
            dequant_from_t: n("NV4_DEQUANT_FROM_T"),
        }
    }
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
            /// The decode kernels' launch shapes these were compiled for.
            pub shapes: LaunchShapes,
            /// Limits.rs's numbers as these kernels were compiled with them.
            numbers: Vec<(&'static str, i64)>,
        }

        impl Kernels {
            pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
                Self::build(ctx, DEFINES.to_vec(), None)
            }

            /// These kernels with the numbers of limits.rs that `defines` names set to its values:
            /// the files that use one are compiled again, the others' functions shared.
            pub fn with_defines(&self, ctx: &Arc<CudaContext>, defines: &[(&str, i64)]) -> Result<Self> {
                let fresh = to_compile(SOURCES, defines);
                Self::build(ctx, numbers(defines, &self.numbers)?, Some((self, fresh)))
            }

            /// Kernels compiled with `numbers`: every file, or those `base` flags (the rest are its).
            fn build(ctx: &Arc<CudaContext>, numbers: Vec<(&'static str, i64)>, base: Option<(&Kernels, Vec<bool>)>) -> Result<Self> {
                let (major, minor) = ctx.compute_capability().map_err(|e| driver_err("compute capability", e))?;
                let arch = format!("sm_{major}{minor}");
                let fresh = base.as_ref().map_or_else(|| vec![true; SOURCES.len()], |(_, f)| f.clone());
                let chosen: Vec<_> = SOURCES.iter().zip(&fresh).filter(|(_, f)| **f).map(|(s, _)| *s).collect();
                // One PTX per compiled file, in the order of `SOURCES`.
                let mut ptx = compile_all(&arch, &chosen, &numbers)?.into_iter();
                let base = base.map(|(b, _)| b);
                let mut fresh = fresh.into_iter();
                $(
                    let compiled = fresh.next().expect("a flag per file");
                    let ($($name,)*) = match base {
                        Some(b) if !compiled => ($(b.$name.clone(),)*),
                        _ => {
                            let module = load(ctx, $file, ptx.next().expect("one PTX per compiled file"))?;
                            ($(module.load_function(stringify!($name)).map_err(|e| driver_err(concat!("kernel ", stringify!($name)), e))?,)*)
                        }
                    };
                )*
                let sm_count = ctx
                    .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .map_err(|e| driver_err("multiprocessor count", e))? as usize;
                let max_shared = ctx
                    .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                    .map_err(|e| driver_err("shared memory per block", e))? as usize;
                Ok(Kernels { $($($name,)*)* sm_count, max_shared, shapes: LaunchShapes::of(&numbers), numbers })
            }
        }
    };
}

kernels! {
    "elementwise.cu" => [embedding, add, swiglu, gate, narrow_cols, copy_pairs],
    "rope.cu" => [rope, rope_seqs],
    "argmax.cu" => [argmax_part, argmax_rows],
    "logprobs.cu" => [top_logprobs],
    "sample.cu" => [sample_rows],
    "linear.cu" => [linear_rows],
    "attention.cu" => [kv_append, attention],
    "gdn.cu" => [causal_conv1d, gdn_recurrent],
    "moe.cu" => [moe_route, moe_gate_up, moe_down, moe_combine],
    "gemv.cu" => [gemv_bf16, gemv_bf16_t1, gemv_bf16_t2, gemv_bf16_mma1, gemv_bf16_mma2, gemv_bf16_mma1_t16, gemv_bf16_mma2_t16, gemv_nvfp4_t1, gemv_nvfp4_t1s, gemv_nvfp4, gemv_nvfp4_t16],
    "moe_decode.cu" => [moe_dec_route, moe_dec_gate_up_bf16, moe_dec_gate_up_nvfp4, moe_dec_down_bf16, moe_dec_down_bf16_t1, moe_dec_down_nvfp4_t1, moe_dec_down_nvfp4],
    "gdn_decode.cu" => [gdn_dec_conv, gdn_dec_state, gdn_dec_step],
    "random.cu" => [fill_random],
    "timing.cu" => [spin],
    "attn_decode.cu" => [attn_dec_append, attn_dec_split_h1, attn_dec_split_h4, attn_dec_mma_d64, attn_dec_mma_d128, attn_dec_mma_d256, attn_dec_combine],
    "norm.cu" => [rms_norm, add_rms_norm, rms_norm_gated],
    "moe_prefill.cu" => [moe_prefill_route, moe_prefill_plan, moe_prefill_scatter, moe_gemm_gate_up, moe_gemm_down, moe_prefill_combine],
    "flash_attn.cu" => [flash_attn_d64, flash_attn_d128, flash_attn_d256],
    "gdn_chunk.cu" => [gdn_chunk_prep_v64, gdn_chunk_scan_v64, gdn_chunk_prep_v128, gdn_chunk_scan_v128],
    "w4a16.cu" => [nvfp4_repack, nvfp4_dequant, w4a16_gemm, moe_w4_gate_up, moe_w4_down],
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
    use super::{compile_all, numbers, options, source, to_compile, CompileOptions, DEFINES, NAMES, SOURCES};

    /// Needs libnvrtc on the library path (no GPU): the files compile side by side and each PTX
    /// lands with its own file.
    #[test]
    fn every_file_compiles_to_its_own_ptx() {
        let ptx = compile_all("sm_90", SOURCES, DEFINES).unwrap();
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
            ("gdn_decode.cu", crate::ops::gdn::decode::mirrors()),
            ("sample.cu", crate::ops::sample::mirrors()),
            ("w4a16.cu", [crate::w4a16::mirrors(), crate::nvfp4::mirrors()].concat()),
        ];
        for (file, checks) in mirrors {
            let (_, src) = SOURCES.iter().find(|(f, _)| *f == file).unwrap();
            let text = format!("{}\n{}\n", source(file, src).unwrap(), checks.join("\n"));
            let mut options = options("sm_90", DEFINES);
            options.push("-fdevice-syntax-only".into());
            let opts = CompileOptions { options, name: Some(file.into()), ..Default::default() };
            if let Err(e) = cudarc::nvrtc::compile_ptx_with_opts(text, opts) {
                panic!("{file} disagrees with vt-cuda: {e:?}");
            }
        }
    }

    /// A kernel set with other numbers compiles again exactly the files that use one (headers
    /// included), with the new values in place of its base's; an unknown name is an error.
    #[test]
    fn defines_recompile_the_files_that_use_them() {
        let files = |defines: &[(&str, i64)]| -> Vec<&str> {
            SOURCES.iter().zip(to_compile(SOURCES, defines)).filter(|(_, f)| *f).map(|((file, _), _)| *file).collect()
        };
        assert_eq!(files(&[("MOE_NV4_DOWN_U", 3)]), ["moe_decode.cu"]);
        assert_eq!(files(&[("GEMV_NV4_TILES", 2), ("MOE_NV4_WARPS", 4)]), ["gemv.cu", "moe_decode.cu"]);
        assert!(files(&[("NV4_K", 64)]).len() > 3, "nvfp4.cuh's includers and common.cuh use NV4_K");
        assert!(numbers(&[("GEMV_NV4_TILE", 2)], DEFINES).is_err());
        let first = numbers(&[("GEMV_NV4_TILES", 2)], DEFINES).unwrap();
        let second = numbers(&[("GEMV_NV4_MAX_WARPS", 8)], &first).unwrap();
        let o = options("sm_90", &second);
        assert!(o.contains(&"-DGEMV_NV4_TILES=2".to_string()) && o.contains(&"-DGEMV_NV4_MAX_WARPS=8".to_string()));
        assert_eq!(o.iter().filter(|o| o.starts_with("-DGEMV_NV4_TILES=")).count(), 1);
        assert_eq!(o.len(), options("sm_90", DEFINES).len());
    }

    /// The NVFP4 decode kernels compile at the edges of the shapes decode_bench sweeps.
    #[test]
    fn nvfp4_decode_kernels_compile_at_other_shapes() {
        let files: Vec<_> = SOURCES.iter().copied().filter(|(f, _)| ["gemv.cu", "moe_decode.cu"].contains(f)).collect();
        for defines in [
            &[
                ("GEMV_NV4_TILES", 1),
                ("GEMV_NV4_MAX_WARPS", 4),
                ("MOE_NV4_WARPS", 16),
                ("MOE_NV4_U", 1),
                ("MOE_NV4_DOWN_WARPS", 16),
                ("MOE_NV4_DOWN_U", 3),
                ("MOE_NV4_DOWN1_WARPS", 8),
                ("MOE_NV4_DOWN1_U", 9),
            ][..],
            &[
                ("GEMV_NV4_TILES", 8),
                ("GEMV_NV4_MAX_WARPS", 8),
                ("MOE_NV4_WARPS", 4),
                ("MOE_NV4_U", 8),
                ("MOE_NV4_DOWN_WARPS", 4),
                ("MOE_NV4_DOWN_U", 18),
                ("MOE_NV4_DOWN1_WARPS", 4),
                ("MOE_NV4_DOWN1_U", 18),
            ][..],
        ] {
            let numbers = numbers(defines, DEFINES).unwrap();
            assert_eq!(compile_all("sm_90", &files, &numbers).unwrap().len(), 2, "{defines:?}");
        }
    }
}
