//! `vt bench`: batched greedy generation on a checkpoint, or on dummy weights at the shapes of a
//! config.json alone (`--load-format dummy`: random values made on the backend, so a 35B model's
//! benchmark needs neither its 70 GB of weights nor minutes of loading). Reports per batch size,
//! from the second of two runs (the first warms up), the time to first token (the batch's prefill
//! step), time per output token (a decode step), tokens per second and memory, and at batch 1 the
//! decode speed against the weight-bytes roofline (weight bytes one token reads ÷ the copy
//! bandwidth measured here).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::Value;
use vt::checkpoint::{Checkpoint, Config, TensorStore};
use vt::grammar::{ConstraintSpec, GrammarCompiler};
use vt::{
    Backend, Draft, Drafter, DummyNvfp4, DummyWeights, Engine, EngineConfig, Event, Model, Observation, Proposal,
    Request, Result, SamplingParams, SeqId,
};

use crate::ranks::Ranks;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFormat {
    /// The checkpoint's safetensors.
    Auto,
    /// Random bf16 weights at the config's shapes.
    Dummy,
    /// Random weights, projections and experts NVFP4 (routers, gates, embeddings, LM head bf16).
    DummyNvfp4,
    /// Random weights, only the routed experts NVFP4 (as NVIDIA's ModelOpt Qwen3.5 exports).
    DummyNvfp4Experts,
}

/// `config.json` of `dir` cut to its first `layers` layers (`num_hidden_layers` and every per-layer
/// list, an array as long as the layer count, of the text config), and without its
/// multi-token-prediction layer unless `mtp` (a run that does not speculate neither loads nor
/// makes its weights, nor gives its KV room in the pool).
fn config(dir: &Path, layers: Option<usize>, mtp: bool) -> Result<Config> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| vt::Error::Io { path: path.clone(), source })?;
    let mut root: Value =
        serde_json::from_str(&text).map_err(|source| vt::Error::Json { path: path.clone(), source })?;
    let text_cfg =
        if root.get("text_config").is_some_and(Value::is_object) { &mut root["text_config"] } else { &mut root };
    let total = text_cfg.get("num_hidden_layers").and_then(Value::as_u64).unwrap_or(0) as usize;
    if let Some(obj) = text_cfg.as_object_mut() {
        if !mtp {
            obj.remove("mtp_num_hidden_layers");
        }
        if let Some(n) = layers {
            for v in obj.values_mut() {
                if let Some(list) = v.as_array_mut().filter(|l| l.len() == total) {
                    list.truncate(n);
                }
            }
            obj.insert("num_hidden_layers".into(), n.min(total).into());
        }
    }
    Config::from_str(&path, &root.to_string())
}

/// The model of `dir`, from its weights or made up (`format`), cut to `layers` layers if given,
/// with its MTP layer where it has one and `mtp`, split over `ranks` where there are several.
pub fn load<B: Backend>(
    ranks: &Ranks<B>,
    dir: &Path,
    format: LoadFormat,
    layers: Option<usize>,
    mtp: bool,
) -> Result<Model<B>> {
    let config = config(dir, layers, mtp)?;
    let tensors = match format {
        LoadFormat::Auto => TensorStore::open_dir(dir)?,
        _ => TensorStore::open_files(dir, &[])?,
    };
    let ckpt = Checkpoint { dir: dir.to_path_buf(), config, tensors };
    let dummy = match format {
        LoadFormat::Auto => None,
        LoadFormat::Dummy => Some(DummyWeights { seed: 0, nvfp4: DummyNvfp4::Off }),
        LoadFormat::DummyNvfp4 => Some(DummyWeights { seed: 0, nvfp4: DummyNvfp4::Projections }),
        LoadFormat::DummyNvfp4Experts => Some(DummyWeights { seed: 0, nvfp4: DummyNvfp4::RoutedExperts }),
    };
    ranks.model(&ckpt, dummy, &|_, _| {})
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
    /// Drafts verified in every decode step (the model's MTP layer's where it has one, else
    /// `RepeatDrafter`'s); 0: none.
    pub speculative_tokens: usize,
}

/// Drafts the sequence's last token `k` times, always: every decode step verifies `k` drafts,
/// so a run times the verification step at `k` whatever the acceptance (which random weights
/// make meaningless). For models without an MTP layer, whose drafts would otherwise come from
/// prompt lookup (none for the bench's prompts).
struct RepeatDrafter;

impl<B: Backend> Drafter<B> for RepeatDrafter {
    fn propose(&mut self, _: &Model<B>, seqs: &mut [Proposal<'_, B>]) -> Result<Vec<Draft>> {
        Ok(seqs.iter().map(|p| Draft { tokens: vec![p.tokens[p.tokens.len() - 1]; p.k], probs: None }).collect())
    }

    fn observe(&mut self, _: &Model<B>, _: &mut [Observation<'_, B>]) -> Result<()> {
        Ok(())
    }

    fn fork(&mut self, _: &Model<B>, _: SeqId, _: SeqId) -> Result<()> {
        Ok(())
    }

    fn release(&mut self, _: SeqId) {}
}

/// Seconds of one batch's generation.
struct Timed {
    /// The first step: the prompts' prefill and each sequence's first token.
    ttft: f64,
    /// The rest.
    decode: f64,
    /// Each decode step, sorted.
    steps: Vec<f64>,
    /// Each decode step's time in the drafter, the rest of it (the verification), and of that
    /// the settling of the verified states, sorted.
    drafting: Vec<f64>,
    verifying: Vec<f64>,
    settling: Vec<f64>,
    /// Tokens generated in all.
    generated: usize,
}

/// Generates `shape.gen_len` tokens for each of `n` prompts of `shape.prompt_len` tokens.
fn generate<B: Backend>(engine: &mut Engine<B>, n: usize, shape: &Shape) -> Result<Timed> {
    let vocab = engine.model().spec().vocab;
    // Tokens sent (a step runs more where it verifies drafts).
    let emitted = Arc::new(AtomicUsize::new(0));
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
        let count = emitted.clone();
        let sink = Box::new(move |e| {
            if matches!(e, Event::Token(_)) {
                count.fetch_add(1, Ordering::Relaxed);
            }
            true
        });
        engine.add(req, sink).map_err(|e| vt::Error::input(format!("{e:?}")))?;
    }
    let started = Instant::now();
    engine.step();
    let ttft = started.elapsed().as_secs_f64();
    let (mut steps, mut drafting, mut verifying, mut settling) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    while engine.has_work() {
        let (t0, drafted, settled) = (Instant::now(), engine.draft_time(), engine.settle_time());
        engine.step();
        let (step, draft) = (t0.elapsed().as_secs_f64(), (engine.draft_time() - drafted).as_secs_f64());
        steps.push(step);
        drafting.push(draft);
        verifying.push(step - draft);
        settling.push((engine.settle_time() - settled).as_secs_f64());
    }
    let generated = emitted.load(Ordering::Relaxed);
    for v in [&mut steps, &mut drafting, &mut verifying, &mut settling] {
        v.sort_by(f64::total_cmp);
    }
    let decode = started.elapsed().as_secs_f64() - ttft;
    Ok(Timed { ttft, decode, steps, drafting, verifying, settling, generated })
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
        speculative_tokens: shape.speculative_tokens,
        ..Default::default()
    };
    let mtp = model.has_mtp();
    let mut engine = Engine::new(model, config)?;
    if shape.speculative_tokens > 0 && !mtp {
        engine.set_drafter(Box::new(RepeatDrafter));
    }
    if shape.speculative_tokens > 0 {
        println!(
            "speculation: {} drafts a step by {}; a step's tokens at per-draft acceptance a are \
             sum_{{i=0..k}} a^i (drafts accepted in order until the first rejection, plus the target's own)",
            shape.speculative_tokens,
            if mtp { "the MTP layer" } else { "repeating the last token" },
        );
    }
    for &n in &shape.batch {
        // Each batch size runs once untimed first: the first run of a shape pays one-off costs
        // that a served model pays once (the weights' derived state, the first use of each kernel
        // and GEMM shape: on the H200 a 32-token prefill took 185 ms the first time, 19 the next).
        // The timed run's sequences take the states the first run's finished sequences left, as
        // a server's later requests do, with their recorded decode steps.
        let _ = generate(&mut engine, n, shape)?;
        let (drafted, accepted) = engine.speculation_stats();
        let Timed { ttft, decode, steps, drafting, verifying, settling, generated } = generate(&mut engine, n, shape)?;
        let speculation = match engine.speculation_stats() {
            (d, _) if d == drafted => String::new(),
            (d, a) => format!("; drafts accepted {} of {}", a - accepted, d - drafted),
        };
        let tpot = decode / steps.len().max(1) as f64;
        // The median step shows the steady state apart from the odd slow step (a recording, a
        // cache that moves, the host being busy), which the mean includes.
        let median = steps.get(steps.len() / 2).copied().unwrap_or(0.0);
        let tok_s = (generated - n) as f64 / decode;
        let vs_roofline =
            if n == 1 { format!(", {:.0}% of the roofline", 100.0 * tok_s / roofline) } else { String::new() };
        println!(
            "batch {n:>3}: TTFT {:>8.1} ms (prefill {:>7.0} tok/s), TPOT {:>7.2} ms (median step {:.2} ms), decode {:>8.1} tok/s{vs_roofline} ({} tokens in {} steps{speculation}); memory {:.2} GiB live, {:.2} GiB peak",
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
        if shape.speculative_tokens > 0 {
            println!("{}", speculation_line(shape.speculative_tokens, n, median, [&drafting, &verifying, &settling]));
        }
    }
    Ok(())
}

/// Tokens a verification step yields when each of `k` drafts is accepted with probability `a`,
/// in order until the first rejection, plus the target's own token: sum_{i=0..k} a^i.
pub fn tokens_per_step(k: usize, a: f64) -> f64 {
    (0..=k).map(|i| a.powi(i as i32)).sum()
}

/// A batch's speculation figures: the median decode step's time in the drafter, in the rest and
/// in the rest's settling of the verified states (`drafting`, `verifying`, `settling`: each
/// step's, sorted), and the throughput the median step gives at acceptance rates 0.6, 0.7 and 0.8.
fn speculation_line(k: usize, batch: usize, median_step: f64, [drafting, verifying, settling]: [&[f64]; 3]) -> String {
    let median = |v: &[f64]| v.get(v.len() / 2).copied().unwrap_or(0.0);
    let at: Vec<String> = [0.6, 0.7, 0.8]
        .iter()
        .map(|&a| {
            let per_step = tokens_per_step(k, a);
            format!("a={a}: {per_step:.2} tok/step, {:.0} tok/s", batch as f64 * per_step / median_step)
        })
        .collect();
    format!(
        "  k {k}, batch {batch}: drafting {:.3} ms, verification {:.3} ms ({} positions a sequence; settling {:.3} ms) per step (medians); {}",
        median(drafting) * 1e3,
        median(verifying) * 1e3,
        k + 1,
        median(settling) * 1e3,
        at.join("; ")
    )
}

/// Workload 5(a) of #30: multi-turn conversations over one long shared prefix (a system prompt,
/// tools), the pattern prefix caching is for.
pub struct MultiTurn {
    /// Tokens every conversation starts with.
    pub prefix_len: usize,
    pub conversations: usize,
    /// Turns per conversation: each turn's prompt is the last one's, its reply and a new message.
    pub turns: usize,
    /// Tokens of each user message.
    pub message_len: usize,
    /// Tokens generated per turn.
    pub gen_len: usize,
    /// Most tokens a step runs (prompt chunks of the 64 conversations share it).
    pub max_batch_tokens: usize,
    /// Fraction of the device's memory the run may use (as `Shape`'s).
    pub gpu_memory_utilization: f64,
}

/// Runs `w` once: every conversation's first turn is submitted at once (after one request of the
/// prefix alone, which a served system prompt would have had long before), and each later turn
/// as soon as that conversation's previous reply ends. Reports the time to first token of each
/// turn, from its submission, over all conversations (p50, p99), and what the prefix cache hit.
pub fn run_multi_turn<B: Backend>(model: Model<B>, w: &MultiTurn, prefix_cache: bool) -> Result<()>
where
    Model<B>: Send,
{
    use std::sync::{Arc, Mutex};
    let vocab = model.spec().vocab as u32;
    let tokens = |seed: usize, n: usize| -> Vec<u32> {
        (0..n).map(|j| ((seed * 7919 + j * 104_729 + 13) % vocab as usize) as u32).collect()
    };
    let config = EngineConfig {
        max_seqs: w.conversations,
        max_batch_tokens: w.max_batch_tokens,
        max_context: w.prefix_len + w.turns * (w.message_len + w.gen_len) + 1,
        prefix_cache,
        gpu_memory_utilization: w.gpu_memory_utilization,
        ..Default::default()
    };
    let mut engine = Engine::new(model, config)?;
    // What each conversation's sink saw: when its first token came, and the tokens.
    type Seen = Arc<Mutex<(Option<Instant>, Vec<u32>, bool)>>;
    let submit = |engine: &mut Engine<B>, prompt: Vec<u32>| -> Result<(Seen, Instant)> {
        let seen: Seen = Arc::default();
        let s = seen.clone();
        let sink = Box::new(move |e: vt::Event| {
            let mut s = s.lock().expect("a sink's lock");
            match e {
                vt::Event::Token(t) => {
                    s.0.get_or_insert_with(Instant::now);
                    s.1.push(t);
                }
                vt::Event::Done(_) | vt::Event::Failed(_) => s.2 = true,
                vt::Event::Logprobs(_) => {}
            }
            true
        });
        let req = Request { prompt, max_tokens: w.gen_len, sampling: SamplingParams::greedy(), ..Default::default() };
        engine.add(req, sink).map_err(|e| vt::Error::input(format!("{e}")))?;
        Ok((seen, Instant::now()))
    };
    let prefix = tokens(0, w.prefix_len);
    let (warm, _) = submit(&mut engine, [prefix.clone(), tokens(1, w.message_len)].concat())?;
    while engine.has_work() {
        engine.step();
    }
    drop(warm);
    let mut prompts: Vec<Vec<u32>> =
        (0..w.conversations).map(|c| [prefix.clone(), tokens(100 + c, w.message_len)].concat()).collect();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); w.turns];
    let mut live: Vec<Option<(Seen, Instant, usize)>> = Vec::with_capacity(w.conversations);
    for p in &prompts {
        let (seen, at) = submit(&mut engine, p.clone())?;
        live.push(Some((seen, at, 0)));
    }
    let started = Instant::now();
    // Each step's time and tokens: where the TTFT goes (prompt chunks against decodes).
    let mut steps: Vec<(f64, usize)> = Vec::new();
    while engine.has_work() {
        let t0 = Instant::now();
        let ran = engine.step();
        steps.push((t0.elapsed().as_secs_f64() * 1e3, ran));
        for (c, slot) in live.iter_mut().enumerate() {
            let Some((seen, at, turn)) = slot.take() else { continue };
            let (first, reply, done) = seen.lock().expect("a sink's lock").clone();
            if !done {
                *slot = Some((seen, at, turn));
                continue;
            }
            let first = first.ok_or_else(|| vt::Error::input(format!("conversation {c} turn {turn} failed")))?;
            ttft[turn].push(first.duration_since(at).as_secs_f64());
            if turn + 1 < w.turns {
                let next =
                    [std::mem::take(&mut prompts[c]), reply, tokens(1000 * (turn + 2) + c, w.message_len)].concat();
                prompts[c] = next.clone();
                let (seen, at) = submit(&mut engine, next)?;
                *slot = Some((seen, at, turn + 1));
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let pct = |v: &[f64], p: f64| v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0) * 1e3;
    println!(
        "multi-turn: {}-token shared prefix, {} conversations x {} turns, {}-token messages, {} generated per turn, {} tokens a step, prefix cache {}; {wall:.2} s",
        w.prefix_len,
        w.conversations,
        w.turns,
        w.message_len,
        w.gen_len,
        w.max_batch_tokens,
        if prefix_cache { "on" } else { "off" }
    );
    for (turn, v) in ttft.iter_mut().enumerate() {
        v.sort_by(f64::total_cmp);
        println!(
            "turn {}: TTFT p50 {:>9.1} ms, p99 {:>9.1} ms ({} requests)",
            turn + 1,
            pct(v, 0.5),
            pct(v, 0.99),
            v.len()
        );
    }
    let mut all: Vec<f64> = ttft.concat();
    all.sort_by(f64::total_cmp);
    println!("all turns: TTFT p50 {:>9.1} ms, p99 {:>9.1} ms", pct(&all, 0.5), pct(&all, 0.99));
    print_steps(&steps, w.conversations);
    let st = engine.prefix_stats();
    println!(
        "prefix cache: {} of {} lookups hit, {} of {} prompt tokens served from it ({:.1}%), {} blocks cached",
        st.hits,
        st.lookups,
        st.hit_tokens,
        st.prompt_tokens,
        100.0 * st.hit_tokens as f64 / st.prompt_tokens.max(1) as f64,
        engine.cached_blocks()
    );
    Ok(())
}

/// Where a workload's steps went: those that ran prompt chunks (more tokens than one per
/// sequence) and those that only decoded, and the slowest few.
fn print_steps(steps: &[(f64, usize)], seqs: usize) {
    let (prompt, decode): (Vec<_>, Vec<_>) = steps.iter().partition(|(_, n)| *n > seqs);
    let sum = |v: &[&(f64, usize)]| (v.iter().map(|s| s.0).sum::<f64>(), v.iter().map(|s| s.1).sum::<usize>());
    let ((pt, pn), (dt, dn)) = (sum(&prompt), sum(&decode));
    println!(
        "steps: {} with prompt chunks ({pn} tokens, {pt:.0} ms), {} decode-only ({dn} tokens, {dt:.0} ms)",
        prompt.len(),
        decode.len()
    );
    let mut slow: Vec<(usize, &(f64, usize))> = steps.iter().enumerate().collect();
    slow.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let slow: Vec<String> = slow.iter().take(6).map(|(i, (ms, n))| format!("#{i} {ms:.0} ms/{n} tok")).collect();
    println!("slowest steps: {}", slow.join(", "));
}

/// Workload 5(b) of #30: how many sequences of `context` positions the pool holds at once.
pub struct Hold {
    pub context: usize,
    /// Sequences submitted at once, and the engine's limit on running ones.
    pub seqs: usize,
    /// Tokens each generates past the steps that admit the others (three a sequence: a prompt
    /// runs in up to two chunks, split where the prefix cache snapshots it, beside the decodes),
    /// so the first is still running when the last starts; its prompt is the rest of the context.
    pub gen_len: usize,
    pub gpu_memory_utilization: f64,
    pub prefix_cache: bool,
}

/// Runs `w`: submits every sequence, steps until all finish, and reports the most that ran at
/// once and the blocks they held, beside what the pool's sizes allow (its blocks over a
/// sequence's, and its linear-attention slots).
pub fn run_hold<B: Backend>(model: Model<B>, w: &Hold) -> Result<()>
where
    Model<B>: Send,
{
    let config = EngineConfig {
        max_seqs: w.seqs,
        max_batch_tokens: 8192,
        max_queue: w.seqs,
        max_context: w.context,
        gpu_memory_utilization: w.gpu_memory_utilization,
        prefix_cache: w.prefix_cache,
        ..Default::default()
    };
    let mut engine = Engine::new(model, config)?;
    let shape = engine.pool_shape().clone();
    let per_seq = shape.peak_blocks(w.context, 8192);
    let stats = engine.pool_stats();
    let by_blocks =
        (shape.totals().iter().zip(&per_seq)).map(|(&total, &need)| total / need.max(1)).min().unwrap_or(usize::MAX);
    let vocab = engine.model().spec().vocab;
    let gen_len = (3 * w.seqs + w.gen_len).min(w.context - 1);
    let prompt_len = w.context - gen_len;
    for i in 0..w.seqs {
        let prompt = (0..prompt_len).map(|j| ((i * 131 + j * 17 + 1) % vocab) as u32).collect();
        let req = Request { prompt, max_tokens: gen_len, sampling: SamplingParams::greedy(), ..Default::default() };
        engine.add(req, Box::new(|_| true)).map_err(|e| vt::Error::input(format!("{e:?}")))?;
    }
    let started = Instant::now();
    let (mut peak, mut peak_blocks) = (0, 0);
    // Until all run at once (the rest of their generation shows nothing more), or all are done.
    while engine.has_work() && peak < w.seqs {
        engine.step();
        let used = engine.pool_stats().blocks_used;
        if engine.running() > peak || (engine.running() == peak && used > peak_blocks) {
            (peak, peak_blocks) = (engine.running(), used);
        }
    }
    println!(
        "pool: {} blocks of {} positions ({:?} a sequence of {} positions: room for {by_blocks}), {} linear-attention slots ({} for sequences, the rest prefix-cache snapshots)",
        stats.blocks_total,
        shape.block_size(),
        per_seq,
        w.context,
        stats.slots_total,
        w.seqs.min(stats.slots_total),
    );
    println!(
        "held {peak} of {} sequences of {} positions at once ({} blocks in use), {} preempted, in {:.1} s; the pool's arithmetic allows {}",
        w.seqs,
        w.context,
        peak_blocks,
        engine.preemptions(),
        started.elapsed().as_secs_f64(),
        by_blocks.min(w.seqs)
    );
    Ok(())
}
