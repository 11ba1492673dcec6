//! `vt bench`: batched greedy generation on a checkpoint, or on dummy weights at the shapes of a
//! config.json alone (`--load-format dummy`: random values made on the backend, so a 35B model's
//! benchmark needs neither its 70 GB of weights nor minutes of loading). Reports per batch size,
//! from the second of two runs (the first warms up), the time to first token (the batch's prefill
//! step), time per output token (a decode step), tokens per second and memory, and at batch 1 the
//! decode speed against the weight-bytes roofline (weight bytes one token reads ÷ the copy
//! bandwidth measured here).

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::Value;
use vt::checkpoint::{Checkpoint, Config, TensorStore};
use vt::grammar::{ConstraintSpec, GrammarCompiler};
use vt::{Backend, DummyWeights, Engine, EngineConfig, Model, Request, Result, SamplingParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFormat {
    /// The checkpoint's safetensors.
    Auto,
    /// Random bf16 weights at the config's shapes.
    Dummy,
    /// Random weights, projections and experts NVFP4 (as NVFP4 checkpoints store them).
    DummyNvfp4,
}

/// `config.json` of `dir` cut to its first `layers` layers: `num_hidden_layers` and every per-layer
/// list (an array as long as the layer count) of the text config.
fn config(dir: &Path, layers: Option<usize>) -> Result<Config> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| vt::Error::Io { path: path.clone(), source })?;
    let Some(n) = layers else { return Config::from_str(&path, &text) };
    let mut root: Value =
        serde_json::from_str(&text).map_err(|source| vt::Error::Json { path: path.clone(), source })?;
    let text_cfg =
        if root.get("text_config").is_some_and(Value::is_object) { &mut root["text_config"] } else { &mut root };
    let total = text_cfg.get("num_hidden_layers").and_then(Value::as_u64).unwrap_or(0) as usize;
    if let Some(obj) = text_cfg.as_object_mut() {
        for v in obj.values_mut() {
            if let Some(list) = v.as_array_mut().filter(|l| l.len() == total) {
                list.truncate(n);
            }
        }
        obj.insert("num_hidden_layers".into(), n.min(total).into());
    }
    Config::from_str(&path, &root.to_string())
}

/// The model of `dir`, from its weights or made up (`format`), cut to `layers` layers if given.
pub fn load<B: Backend>(backend: &B, dir: &Path, format: LoadFormat, layers: Option<usize>) -> Result<Model<B>> {
    let config = config(dir, layers)?;
    let tensors = match format {
        LoadFormat::Auto => TensorStore::open_dir(dir)?,
        _ => TensorStore::open_files(dir, &[])?,
    };
    let ckpt = Checkpoint { dir: dir.to_path_buf(), config, tensors };
    match format {
        LoadFormat::Auto => Model::from_checkpoint(backend, &ckpt, &|_, _| {}),
        LoadFormat::Dummy => Model::dummy(backend, &ckpt, DummyWeights { seed: 0, nvfp4: false }),
        LoadFormat::DummyNvfp4 => Model::dummy(backend, &ckpt, DummyWeights { seed: 0, nvfp4: true }),
    }
}

/// Copy bandwidth (bytes read + written per second) of a 64M-element activation tensor (larger
/// than any cache) on a device backend: back-to-back copies for about 50 ms (5 to 200 of them), one
/// wait at the end, so the wait's latency and the first copy's allocation weigh little (the device
/// allocator hands the freed output back to the next copy).
pub fn copy_bandwidth<B: Backend>(b: &B) -> Result<f64> {
    let (rows, width, dtype) = (1 << 13, 8192, b.activation_dtype());
    let big = b.random(dtype, &[rows, width], 1, 1.0)?;
    b.to_f32(&b.slice_rows(&big, 0, 1)?)?; // waits for the fill
    let copies = |n: usize| -> Result<f64> {
        let t0 = Instant::now();
        for _ in 1..n {
            b.slice_rows(&big, 0, rows)?;
        }
        let last = b.slice_rows(&big, 0, rows)?;
        b.to_f32(&b.slice_rows(&last, 0, 1)?)?; // waits for the copies
        Ok(t0.elapsed().as_secs_f64())
    };
    let n = ((0.05 / copies(1)?) as usize).clamp(5, 200);
    Ok(2.0 * (n * dtype.bytes_for(rows * width).unwrap_or(0)) as f64 / copies(n)?)
}

/// Copy bandwidth of host memory, for the CPU backend, whose weights live there: 256 MB copied
/// between two buffers already mapped, split over rayon's threads as vt-cpu's ops are, for about
/// 50 ms. (The device probe's copies through the backend each map a fresh output, so on the host
/// it measured page faults: 5 GB/s and a decode at "196 % of the roofline" on this project's CI
/// machine.)
pub fn host_copy_bandwidth() -> f64 {
    const BYTES: usize = 256 << 20;
    const PIECE: usize = 1 << 20;
    let src = vec![1u8; BYTES];
    let mut dst = vec![2u8; BYTES];
    let mut copies = |n: usize| {
        let t0 = Instant::now();
        for _ in 0..n {
            dst.par_chunks_mut(PIECE).zip(src.par_chunks(PIECE)).for_each(|(d, s)| d.copy_from_slice(s));
        }
        t0.elapsed().as_secs_f64()
    };
    let n = ((0.05 / copies(1)) as usize).clamp(3, 200);
    2.0 * (n * BYTES) as f64 / copies(n)
}

/// The grammar of `--json-schema FILE` against the tokenizer in `dir`.
pub fn constraint(dir: &Path, schema: &Path, vocab: usize) -> Result<(GrammarCompiler, ConstraintSpec)> {
    let read = |p: &Path| std::fs::read(p).map_err(|source| vt::Error::Io { path: p.to_path_buf(), source });
    let tokenizer = read(&dir.join("tokenizer.json"))?;
    let schema: Value = serde_json::from_slice(&read(schema)?)
        .map_err(|source| vt::Error::Json { path: schema.to_path_buf(), source })?;
    Ok((GrammarCompiler::new(&tokenizer, &[], vocab)?, ConstraintSpec::JsonSchema(schema)))
}

pub struct Shape {
    pub batch: Vec<usize>,
    pub prompt_len: usize,
    pub gen_len: usize,
    /// Every sequence decodes under this grammar (`--json-schema`), to measure its cost.
    pub constraint: Option<(GrammarCompiler, ConstraintSpec)>,
    /// Fraction of the device's memory the run may use (the KV pool takes what the weights
    /// leave of it).
    pub gpu_memory_utilization: f64,
}

/// Seconds of one batch's generation.
struct Timed {
    /// The first step: the prompts' prefill and each sequence's first token.
    ttft: f64,
    /// The rest.
    decode: f64,
    /// Each decode step, sorted.
    steps: Vec<f64>,
    /// Tokens generated in all.
    generated: usize,
}

/// Generates `shape.gen_len` tokens for each of `n` prompts of `shape.prompt_len` tokens.
fn generate<B: Backend>(engine: &mut Engine<B>, n: usize, shape: &Shape) -> Result<Timed> {
    let vocab = engine.model().spec().vocab;
    for i in 0..n {
        let prompt = (0..shape.prompt_len).map(|j| ((i * 131 + j * 17 + 1) % vocab) as u32).collect();
        let grammar = shape.constraint.as_ref().map(|(c, spec)| c.compile(spec)).transpose()?;
        let req = Request {
            prompt,
            max_tokens: shape.gen_len,
            sampling: SamplingParams::greedy(),
            grammar,
            ..Default::default()
        };
        engine.add(req, Box::new(|_| true)).map_err(|e| vt::Error::input(format!("{e:?}")))?;
    }
    let started = Instant::now();
    engine.step();
    let ttft = started.elapsed().as_secs_f64();
    let (mut generated, mut steps) = (n, Vec::new());
    while engine.has_work() {
        let t0 = Instant::now();
        generated += engine.step();
        steps.push(t0.elapsed().as_secs_f64());
    }
    steps.sort_by(f64::total_cmp);
    Ok(Timed { ttft, decode: started.elapsed().as_secs_f64() - ttft, steps, generated })
}

/// `bandwidth`: the copy bandwidth the roofline divides (`copy_bandwidth` on a device,
/// `host_copy_bandwidth` on the CPU).
pub fn run<B: Backend>(backend: &B, model: Model<B>, shape: &Shape, bandwidth: f64) -> Result<()>
where
    Model<B>: Send,
{
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let weights = backend.memory().bytes_live;
    let token_bytes = model.decode_weight_bytes();
    let roofline = bandwidth / token_bytes as f64;
    println!(
        "weights {:.2} GiB resident; one decode token reads {:.1} MB; copy bandwidth {:.0} GB/s: roofline {roofline:.0} tok/s at batch 1",
        gib(weights),
        token_bytes as f64 / 1e6,
        bandwidth / 1e9
    );
    let config = EngineConfig {
        max_seqs: shape.batch.iter().copied().max().unwrap_or(1),
        max_batch_tokens: usize::MAX,
        max_context: shape.prompt_len + shape.gen_len,
        gpu_memory_utilization: shape.gpu_memory_utilization,
        ..Default::default()
    };
    let mut engine = Engine::new(model, config)?;
    for &n in &shape.batch {
        // Each batch size runs once untimed first: the first run of a shape pays one-off costs
        // that a served model pays once (the weights' derived state, the first use of each kernel
        // and GEMM shape: on the H200 a 32-token prefill took 185 ms the first time, 19 the next).
        // The timed run's sequences take the states the first run's finished sequences left, as
        // a server's later requests do, with their recorded decode steps.
        let _ = generate(&mut engine, n, shape)?;
        let Timed { ttft, decode, steps, generated } = generate(&mut engine, n, shape)?;
        let tpot = decode / steps.len().max(1) as f64;
        // The median step shows the steady state apart from the odd slow step (a recording, a
        // cache that moves, the host being busy), which the mean includes.
        let median = steps.get(steps.len() / 2).copied().unwrap_or(0.0);
        let tok_s = (generated - n) as f64 / decode;
        let vs_roofline =
            if n == 1 { format!(", {:.0}% of the roofline", 100.0 * tok_s / roofline) } else { String::new() };
        println!(
            "batch {n:>3}: TTFT {:>8.1} ms (prefill {:>7.0} tok/s), TPOT {:>7.2} ms (median step {:.2} ms), decode {:>8.1} tok/s{vs_roofline} ({} tokens in {} steps); memory {:.2} GiB live, {:.2} GiB peak",
            ttft * 1e3,
            (n * shape.prompt_len) as f64 / ttft,
            tpot * 1e3,
            median * 1e3,
            tok_s,
            generated - n,
            steps.len(),
            gib(backend.memory().bytes_live),
            gib(backend.memory().peak_bytes)
        );
    }
    Ok(())
}
