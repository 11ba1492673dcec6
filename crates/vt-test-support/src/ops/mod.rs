//! The op-by-op parity tests against vt-cpu: their bodies (`suite`, one per test, which every
//! GPU backend's tests/ops.rs runs through `op_tests!`), and what they are made of: a seeded
//! generator, weights in every stored format as host data any backend uploads, the comparison
//! (`on_both!`) and the report of one op's error.

pub mod suite;

use vt_core::backend::Backend;
use vt_core::{DType, Expert, Fp8Block, KvLayout, Linear, MoeExperts, Nvfp4, Router, RouterKind, Tensor, Weight};

/// A backend under test and what its ops are held to.
pub struct OnDevice<G> {
    pub backend: G,
    /// The name reports give it.
    pub name: &'static str,
    /// The error relative to the output's scale of one op's output, rounded once to the
    /// activation dtype after f32 accumulation: the unit the suite's bounds are counted in.
    pub u: f32,
    /// Head dimensions at which attention rounds its probabilities to the activation dtype for
    /// P V (a second rounding: 2u).
    pub rounded_probabilities: &'static [usize],
}

impl<G> OnDevice<G> {
    /// Attention's bound at head dimension `d`.
    pub fn attention_bound(&self, d: usize) -> f32 {
        if self.rounded_probabilities.contains(&d) {
            2.0 * self.u
        } else {
            self.u
        }
    }
}

/// Expands `$body` once with `$b` a fresh vt-cpu backend and once with `$dev`'s backend (an
/// `OnDevice`, made once per test: a GPU backend compiles its kernels when it starts), then
/// reports and checks the error against `$bound`.
#[macro_export]
macro_rules! on_both {
    ($dev:expr, $op:expr, $bound:expr, |$b:ident| $body:block) => {{
        let cpu: Vec<f32> = {
            let $b = &$crate::ops::Reference::new();
            $body
        };
        let gpu: Vec<f32> = {
            let $b = &$dev.backend;
            $body
        };
        $crate::ops::report($dev.name, $op, $bound, &gpu, &cpu);
    }};
}

/// One `#[test]` per named body of `suite`, each on a fresh `$device` (an `OnDevice`).
#[macro_export]
macro_rules! op_tests {
    ($device:expr => $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::ops::suite::$name(&$device);
            }
        )*
    };
}

/// The backend every op is compared with.
pub use vt_cpu::CpuBackend as Reference;

/// xorshift64*: the same numbers on every machine, no dependency.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` values uniform in [-scale, scale), rounded to bf16.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| half::bf16::from_f32(self.f32() * scale).to_f32()).collect()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.f32().to_bits() >> 8) as u8).collect()
    }
    /// `0..n` in a random order.
    pub fn shuffled(&mut self, n: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            let j = (((self.f32() + 1.0) / 2.0 * (i + 1) as f32) as usize).min(i);
            v.swap(i, j);
        }
        v
    }
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()
}

/// A weight's stored form, uploadable to any backend.
#[derive(Clone)]
pub enum HostWeight {
    Bf16 { n: usize, k: usize, v: Vec<f32> },
    F32 { n: usize, k: usize, v: Vec<f32> },
    Nvfp4 { n: usize, k: usize, codes: Vec<u8>, scales: Vec<u8>, global: f32 },
    Fp8 { n: usize, k: usize, values: Vec<u8>, scales: Vec<f32>, block: [usize; 2] },
}

impl HostWeight {
    pub fn bf16(r: &mut Rng, n: usize, k: usize) -> Self {
        HostWeight::Bf16 { n, k, v: r.vec(n * k, 1.0 / (k as f32).sqrt()) }
    }
    pub fn f32(r: &mut Rng, n: usize, k: usize) -> Self {
        HostWeight::F32 { n, k, v: (0..n * k).map(|_| r.f32() / (k as f32).sqrt()).collect() }
    }
    /// Random codes; scales are fp8 e4m3 with exponents around 2^-3 (no NaN codes).
    pub fn nvfp4(r: &mut Rng, n: usize, k: usize) -> Self {
        let scales = r.bytes(n * k / 16).into_iter().map(|b| 0x20 + (b & 0x1f)).collect();
        HostWeight::Nvfp4 { n, k, codes: r.bytes(n * k / 2), scales, global: 0.37 }
    }
    /// e4m3 values in [2^-3, 2^3) in magnitude (no NaN codes), one f32 scale per `block`
    /// (partial blocks where it does not divide the shape) of about 1 / (2 sqrt(k)).
    pub fn fp8(r: &mut Rng, n: usize, k: usize, block: [usize; 2]) -> Self {
        let values = r.bytes(n * k).into_iter().map(|b| (b & 0x87) | ((4 + (b >> 3) % 6) << 3)).collect();
        let blocks = n.div_ceil(block[0]) * k.div_ceil(block[1]);
        let scales = (0..blocks).map(|_| (1.5 + r.f32()) / (4.0 * (k as f32).sqrt())).collect();
        HostWeight::Fp8 { n, k, values, scales, block }
    }
    pub fn name(&self) -> &'static str {
        match self {
            HostWeight::Bf16 { .. } => "bf16",
            HostWeight::F32 { .. } => "f32",
            HostWeight::Nvfp4 { .. } => "nvfp4",
            HostWeight::Fp8 { .. } => "fp8",
        }
    }
    pub fn upload<B: Backend>(&self, b: &B) -> Weight<B> {
        match self {
            HostWeight::Bf16 { n, k, v } => Weight::Dense(b.upload(DType::BF16, &[*n, *k], &bf16_bytes(v)).unwrap()),
            HostWeight::F32 { n, k, v } => Weight::Dense(b.upload(DType::F32, &[*n, *k], bytemuck_f32(v)).unwrap()),
            HostWeight::Nvfp4 { n, k, codes, scales, global } => {
                let codes = b.upload(DType::F4x2, &[*n, *k], codes).unwrap();
                let scales = b.upload(DType::F8E4M3, &[*n, *k / 16], scales).unwrap();
                Weight::Nvfp4(Nvfp4::new(b, "nvfp4 weight", codes, scales, *global).unwrap())
            }
            HostWeight::Fp8 { n, k, values, scales, block } => Weight::Fp8(Fp8Block {
                values: b.upload(DType::F8E4M3, &[*n, *k], values).unwrap(),
                scales: b
                    .upload(DType::F32, &[n.div_ceil(block[0]), k.div_ceil(block[1])], bytemuck_f32(scales))
                    .unwrap(),
                block: *block,
            }),
        }
    }
}

pub fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 4) }
}

pub fn act<B: Backend>(b: &B, shape: &[usize], v: &[f32]) -> Tensor<B> {
    b.from_f32(shape, v).unwrap()
}

pub fn small<B: Backend>(b: &B, v: &[f32]) -> Tensor<B> {
    b.upload(DType::BF16, &[v.len()], &bf16_bytes(v)).unwrap()
}

pub fn out<B: Backend>(b: &B, t: &Tensor<B>) -> Vec<f32> {
    b.to_f32(t).unwrap()
}

/// `n_exp` experts' (gate, up, down) in `format` ("bf16", "nvfp4" or "fp8": blocks of 24 x 40,
/// partial in both dimensions of every fixture shape).
pub fn host_experts(r: &mut Rng, format: &str, n_exp: usize, h: usize, inter: usize) -> Vec<[HostWeight; 3]> {
    let weight = |r: &mut Rng, n, k| match format {
        "bf16" => HostWeight::bf16(r, n, k),
        "nvfp4" => HostWeight::nvfp4(r, n, k),
        _ => HostWeight::fp8(r, n, k, [24, 40]),
    };
    (0..n_exp).map(|_| [weight(r, inter, h), weight(r, inter, h), weight(r, h, inter)]).collect()
}

/// A router of `kind` over `weight`; sigmoid routers take `bias` as their correction bias.
pub fn router<B: Backend>(b: &B, weight: &HostWeight, kind: &RouterKind, bias: &[f32]) -> Router<B> {
    let sigmoid = matches!(kind, RouterKind::Sigmoid { .. });
    Router {
        weight: Linear::new(b, weight.upload(b)).unwrap(),
        kind: kind.clone(),
        correction_bias: sigmoid.then(|| small(b, bias)),
    }
}

pub fn upload_experts<B: Backend>(b: &B, experts: &[[HostWeight; 3]], h: usize, inter: usize) -> MoeExperts<B> {
    let ex = experts.iter().map(|[g, u, d]| Expert { gate: g.upload(b), up: u.upload(b), down: d.upload(b) }).collect();
    MoeExperts::new(b, "experts", ex, h, inter).unwrap()
}

/// Prints and checks one op's error relative to the output's scale: max |gpu - cpu| / max |cpu|
/// against `bound`.
pub fn report(backend: &str, op: &str, bound: f32, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{op}: output sizes differ");
    let scale = cpu.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let err = crate::max_abs_diff(gpu, cpu) / scale;
    println!("op {op}: max |{backend} - cpu| / max |cpu| = {err:.3e} (bound {bound:.3e}, {} values)", cpu.len());
    assert!(err.is_finite() && err <= bound, "{op}: relative error {err:.3e} > {bound:.3e}");
}

/// A one-layer KV pool of `hkv` heads x `d` for sequences of `lens` positions, and their block
/// tables: consecutive blocks each where `!scatter`, else one block of each sequence in turn.
pub fn pool_of<B: Backend>(b: &B, hkv: usize, d: usize, lens: &[usize], scatter: bool) -> (B::KvPool, Vec<Vec<u32>>) {
    let bs = b.kv_block_size();
    let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let mut tables: Vec<Vec<u32>> = need.iter().map(|_| Vec::new()).collect();
    let mut next = 0u32;
    if scatter {
        for round in 0..need.iter().copied().max().unwrap_or(0) {
            for (t, &n) in tables.iter_mut().zip(&need) {
                if round < n {
                    t.push(next);
                    next += 1;
                }
            }
        }
    } else {
        for (t, &n) in tables.iter_mut().zip(&need) {
            t.extend(next..next + n as u32);
            next += n as u32;
        }
    }
    let pool = b.new_kv_pool(&[KvLayout { kv_heads: hkv, head_dim: d, blocks: next as usize }]).unwrap();
    (pool, tables)
}
