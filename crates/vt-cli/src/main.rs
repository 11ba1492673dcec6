//! `vt`: run MoE language models from Hugging Face checkpoints.

mod builtin;
mod chat;

use std::io::Write;
use std::net::ToSocketAddrs;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use vt::{Backend, Detokenizer, EngineConfig, EngineHandle, Logits, Model, SamplingParams, Tokenizer};
use vt_cli::bench::{self, LoadFormat};
use vt_cli::hub;
use vt_cli::ranks::{self, Ranks};
use vt_cli::server::{self, BodyLimits, ServerConfig, Transport};

#[derive(Parser)]
#[command(name = "vt", version, about = "Serve sparse mixture-of-experts language models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendKind {
    Cpu,
    Cuda,
    Wgpu,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Checkpoint directory (config.json + *.safetensors), or a hub id (`Qwen/Qwen3.6-35B-A3B`)
    /// from the local Hugging Face cache, downloaded into it when absent. Defaults to the
    /// built-in model.
    #[arg(long)]
    model: Option<String>,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Split the model over N ranks (tensor parallelism): N threads on the CPU, devices 0..N on
    /// CUDA, each holding its part of every layer (docs/parallel.md).
    #[arg(long, default_value_t = 1, value_parser = count(1, 64))]
    tensor_parallel: usize,
    /// Partition the routed experts across the ranks (expert parallelism; with --tensor-parallel).
    #[arg(long)]
    expert_parallel: bool,
}

#[derive(clap::Args)]
struct SampleArgs {
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0, value_parser = count(0, 1 << 24))]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SampleArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..Default::default()
        }
    }
}

/// A parser of whole numbers in `lo..=hi`: every count a flag takes is bounded, so no value can
/// overflow an allocation or a product.
fn count(lo: usize, hi: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s| match s.parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!("`{s}` is not a whole number from {lo} to {hi}")),
    }
}

/// A parser of fractions in (0, 1].
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("`{s}` is not a number in (0, 1]")),
    }
}

/// Tokens any one flag may ask for: 16 Mi, beyond every supported model's context.
const MAX_TOKENS: usize = 1 << 24;

#[derive(clap::Args)]
struct EngineArgs {
    /// Most sequences running at once.
    #[arg(long, default_value_t = 32, value_parser = count(1, 4096))]
    max_seqs: usize,
    /// Most tokens per batched step (decodes plus prompt chunks).
    #[arg(long, default_value_t = 512, value_parser = count(1, MAX_TOKENS))]
    max_batch_tokens: usize,
    /// Most requests waiting for a free sequence slot, beyond those running; more get 429.
    #[arg(long, default_value_t = 256, value_parser = count(0, 1 << 20))]
    max_queue: usize,
    /// Memory for the sequence-state pool (KV blocks, linear-attention states), in MiB. Unset: on
    /// a GPU, --gpu-memory-utilization of its memory less what is in use after loading; on the
    /// CPU, enough for --max-seqs sequences of the full context.
    #[arg(long, value_parser = count(1, 1 << 30))]
    memory_budget_mib: Option<usize>,
    /// Fraction of the GPU's memory the process may use (weights, workspace and the KV pool),
    /// where --memory-budget-mib is unset.
    #[arg(long, default_value_t = 0.9, value_parser = fraction)]
    gpu_memory_utilization: f64,
    /// Recompute every prompt from its first token: no prefix cache (finished prefixes' KV blocks
    /// and linear-attention snapshots kept for prompts that start with them).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Longest sequence (prompt plus generated tokens); the checkpoint's max_position_embeddings
    /// (or 4096 where it states none) if unset, and never more.
    #[arg(long, value_parser = count(2, MAX_TOKENS))]
    max_model_len: Option<usize>,
    /// Speculative decoding: tokens drafted per decode step (by --drafter), verified in one
    /// forward; 0 is off.
    #[arg(long, default_value_t = 0, value_parser = count(0, MAX_DRAFTS))]
    speculative_tokens: usize,
    /// What drafts the speculative tokens.
    #[arg(long, value_enum, default_value = "auto")]
    drafter: DrafterArg,
}

/// Most drafts a step may verify per sequence.
const MAX_DRAFTS: usize = 16;

/// `--drafter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DrafterArg {
    /// The checkpoint's multi-token-prediction layer where it has one, else ngram.
    Auto,
    /// The checkpoint's multi-token-prediction layer (mtp.* tensors).
    Mtp,
    /// Prompt lookup: what followed the latest earlier occurrence of the last few tokens.
    Ngram,
}

impl DrafterArg {
    fn kind(self) -> vt::DrafterKind {
        match self {
            DrafterArg::Auto => vt::DrafterKind::Auto,
            DrafterArg::Mtp => vt::DrafterKind::Mtp,
            DrafterArg::Ngram => vt::DrafterKind::Ngram,
        }
    }
}

/// Drops the model's MTP layer (its weights, and its KV in the pool) where it drafts nothing:
/// without speculation, or with another drafter.
fn keep_mtp_for<B: Backend>(m: &mut Model<B>, speculative_tokens: usize, drafter: DrafterArg) {
    if speculative_tokens == 0 || drafter == DrafterArg::Ngram {
        m.drop_mtp();
    }
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model's name in `/v1/models` and in requests; the checkpoint directory's name if unset.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer <KEY>` on `/v1/*` and `/metrics` (`/health` stays open).
    #[arg(long)]
    api_key: Option<String>,
    /// Browser origins allowed to call the API (CORS), comma-separated; `*` for any. None if unset.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// `max_tokens` of a chat request that sets none (capped by the context left).
    #[arg(long, default_value_t = 1024, value_parser = count(1, MAX_TOKENS))]
    default_max_tokens: usize,
    /// Seconds a client has to send a request's head, and an idle kept-alive connection stays open.
    #[arg(long, default_value_t = 10, value_parser = count(1, 3600))]
    header_timeout_secs: usize,
    /// Seconds a client has to send a whole request body.
    #[arg(long, default_value_t = 30, value_parser = count(1, 3600))]
    body_timeout_secs: usize,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 16, value_parser = count(1, 1024))]
    max_body_mib: usize,
    /// Most connections open at once (the file-descriptor limit is raised to fit, where allowed).
    #[arg(long, default_value_t = 1024, value_parser = count(1, 1 << 20))]
    max_connections: usize,
    /// Seconds a shutdown (SIGINT, SIGTERM) waits for in-flight requests; a second signal exits at once.
    #[arg(long, default_value_t = 30, value_parser = count(0, 3600))]
    drain_timeout_secs: usize,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// A Jinja chat template file to use instead of the checkpoint's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// The tool-call format to parse: qwen3_xml (Qwen3.5/3.6, Qwen3-Coder), hermes (Qwen3),
    /// laguna. Default: the one the chat template teaches, else the model family's.
    #[arg(long)]
    tool_call_parser: Option<String>,
    /// `think`: split <think> reasoning into reasoning_content (the default); `none`: leave it in
    /// the content.
    #[arg(long, default_value = "think", value_parser = ["think", "none"])]
    reasoning_parser: String,
    /// Let special tokens typed in chat messages act as control tokens (by default they are
    /// tokenized as text, so a message cannot forge a turn).
    #[arg(long)]
    special_tokens_in_messages: bool,
}

// Parsed once at startup: a boxed variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Write the logits of every prompt position to a safetensors file (tensor `logits`, f32).
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        /// Comma-separated prompt token ids, e.g. 1,2,3.
        #[arg(long, value_delimiter = ',', required = true)]
        prompt_ids: Vec<u32>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Generate a continuation of the prompt (text, or token ids).
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt text (needs the checkpoint's tokenizer.json).
        #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
        prompt: Option<String>,
        /// Comma-separated prompt token ids, e.g. 1,2,3 (generation then ignores EOS).
        #[arg(long, value_delimiter = ',')]
        prompt_ids: Option<Vec<u32>>,
        /// At most the model's context less the prompt.
        #[arg(long, default_value_t = 64, value_parser = count(1, MAX_TOKENS))]
        max_new_tokens: usize,
        #[command(flatten)]
        sample: SampleArgs,
        /// Print a JSON object (`token_ids`: the generated ids) as the last line of stdout.
        #[arg(long)]
        json: bool,
        /// Speculative decoding: tokens drafted per step (by --drafter), verified in one
        /// forward; 0 is off. The output is the same either way; the drafts accepted are printed.
        #[arg(long, default_value_t = 0, value_parser = count(0, MAX_DRAFTS))]
        speculative_tokens: usize,
        /// What drafts the speculative tokens.
        #[arg(long, value_enum, default_value = "auto")]
        drafter: DrafterArg,
    },
    /// Chat through the model's chat template: line editing and history; Ctrl-C stops a reply,
    /// Ctrl-D (or an empty line) ends.
    Chat {
        #[command(flatten)]
        model: ModelArgs,
        /// Per reply; at most the context left.
        #[arg(long, default_value_t = 256, value_parser = count(1, MAX_TOKENS))]
        max_new_tokens: usize,
        #[command(flatten)]
        sample: SampleArgs,
    },
    /// Serve the OpenAI-compatible API.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        serve: ServeArgs,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        agent: AgentArgs,
    },
    /// Measure batched greedy generation throughput.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, value_delimiter = ',', default_value = "1,8,32", value_parser = count(1, 4096))]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 32, value_parser = count(1, 1 << 20))]
        prompt_len: usize,
        #[arg(long, default_value_t = 32, value_parser = count(1, 1 << 20))]
        gen_len: usize,
        /// `dummy`: random weights at config.json's shapes (the directory needs only config.json).
        #[arg(long, value_enum, default_value = "auto")]
        load_format: LoadFormat,
        /// Keep only the first N layers (a cheaper run at full width).
        #[arg(long, value_parser = count(1, 1 << 16))]
        num_layers: Option<usize>,
        /// Decode op by op: no recorded steps (CUDA graphs, one launch a step), to measure what
        /// they save.
        #[arg(long)]
        unrecorded: bool,
        /// Fraction of the GPU's memory the process may use (weights, workspace, KV pool).
        #[arg(long, default_value_t = 0.9, value_parser = fraction)]
        gpu_memory_utilization: f64,
        /// Decode every sequence under this JSON schema (constrained decoding, masks computed
        /// on the CPU), to measure its cost against a run without it; needs tokenizer.json.
        #[arg(long)]
        json_schema: Option<PathBuf>,
        /// Run the multi-turn workload instead: conversations that share a prefix of this many
        /// tokens, each turn a `--prompt-len`-token message and a `--gen-len`-token reply; reports
        /// time to first token (p50, p99) and the prefix cache's hits.
        #[arg(long, value_parser = count(1, 1 << 20))]
        shared_prefix: Option<usize>,
        /// Conversations of the multi-turn workload, all started at once.
        #[arg(long, default_value_t = 64, value_parser = count(1, 4096))]
        conversations: usize,
        /// Turns per conversation of the multi-turn workload.
        #[arg(long, default_value_t = 2, value_parser = count(1, 1024))]
        turns: usize,
        /// Run the multi-turn workload without prefix caching (the cold figures).
        #[arg(long)]
        no_prefix_cache: bool,
        /// Run the concurrency workload instead: as many sequences as the first `--batch` value
        /// (the engine's sequence limit) of this context, submitted at once, each generating
        /// `--gen-len` tokens more than it takes to admit the others; reports how many the pool
        /// held at once against its arithmetic.
        #[arg(long, value_parser = count(2, 1 << 20), conflicts_with = "shared_prefix")]
        hold_context: Option<usize>,
        /// Verify this many drafted tokens in every decode step, drafted by the checkpoint's MTP
        /// layer where it has one (else the drafts repeat the last token). Reports the drafting
        /// and verification time per step and the throughput that follows at acceptance rates
        /// 0.6, 0.7 and 0.8 (with random weights the measured acceptance means nothing); 0 is off.
        #[arg(long, default_value_t = 0, value_parser = count(0, MAX_DRAFTS))]
        speculative_tokens: usize,
    },
}

/// The checkpoint directory `--model` names: a directory, a hub id (from the local Hugging Face
/// cache, downloaded into it if absent), or (unset) the built-in model.
fn model_dir(model: Option<&str>) -> AnyResult<PathBuf> {
    let Some(m) = model else { return Ok(builtin::model_dir()?) };
    if !hub::is_hub_id(m) {
        return Ok(PathBuf::from(m));
    }
    let env = |k| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let cache = env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")))
        .ok_or("--model: no Hugging Face cache (set HF_HOME or HF_HUB_CACHE)")?;
    Ok(hub::checkpoint_dir(m, &cache)?)
}

/// The longest sequence a checkpoint takes (prompt plus generated): its max_position_embeddings,
/// or 4096 where it states none.
fn context(dir: &Path) -> AnyResult<usize> {
    Ok(vt::context_limit(dir)?.unwrap_or(4096))
}

/// An error unless `prompt` tokens plus `max_new` generated fit the context `ctx`.
fn check_fits(prompt: usize, max_new: usize, ctx: usize) -> AnyResult<()> {
    if prompt == 0 {
        return Err("the prompt is empty".into());
    }
    if prompt >= ctx {
        return Err(format!(
            "the prompt has {prompt} tokens; the model's context is {ctx} (prompt plus at least one generated)"
        )
        .into());
    }
    if max_new > ctx - prompt {
        return Err(format!(
            "--max-new-tokens {max_new} with a {prompt}-token prompt passes the model's context of {ctx} tokens (at most {})",
            ctx - prompt
        )
        .into());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn run(cli: Cli) -> AnyResult<()> {
    let args = match &cli.command {
        Command::Logits { model, .. }
        | Command::Generate { model, .. }
        | Command::Chat { model, .. }
        | Command::Serve { model, .. }
        | Command::Bench { model, .. } => model,
    };
    let (n, ep) = (args.tensor_parallel, args.expert_parallel);
    match args.backend {
        BackendKind::Cpu => run_on(&ranks::cpu(n, ep)?, &cli),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda if n == 1 => run_on(&ranks::single(vt::CudaBackend::new()?, 1, "cuda")?, &cli),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => run_on(&ranks::cuda(n, ep)?, &cli),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err("this build has no CUDA backend (build vt with --features cuda)".into()),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => {
            let b = vt::WgpuBackend::new()?;
            eprintln!("wgpu adapter: {}", b.adapter());
            run_on(&ranks::single(b, n, "wgpu")?, &cli)
        }
        #[cfg(not(feature = "wgpu"))]
        BackendKind::Wgpu => Err("this build has no wgpu backend (build vt with --features wgpu)".into()),
    }
}

/// Loads the weights with a progress bar (bytes uploaded) on a terminal; split over the ranks
/// where there are several.
fn load<B: Backend>(ranks: &Ranks<B>, args: &ModelArgs) -> AnyResult<(Model<B>, PathBuf)> {
    let dir = model_dir(args.model.as_deref())?;
    let bar = indicatif::ProgressBar::new(0)
        .with_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
                .expect("a valid template")
                .progress_chars("=> "),
        )
        .with_message(format!("loading {}", dir.display()));
    let model = vt::checkpoint::Checkpoint::open(&dir).and_then(|ckpt| {
        ranks.model(&ckpt, None, &|done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })
    });
    bar.finish_and_clear();
    let model = model?;
    // Refuses a config whose context cannot work, before anything runs.
    context(&dir)?;
    Ok((model, dir))
}

fn tokenizer(dir: &Path) -> AnyResult<Tokenizer> {
    Tokenizer::load(dir)?
        .ok_or_else(|| format!("{} has no tokenizer.json; pass --prompt-ids instead", dir.display()).into())
}

fn stop_ids<B: Backend>(m: &Model<B>, tok: &Tokenizer) -> Vec<u32> {
    tok.eos_id().into_iter().chain(m.spec().eos_token_ids.iter().copied()).collect()
}

fn run_on<B: Backend>(ranks: &Ranks<B>, cli: &Cli) -> AnyResult<()>
where
    Model<B>: Send,
{
    let backend = ranks.first();
    match &cli.command {
        Command::Logits { model, prompt_ids, out } => {
            let (m, dir) = load(ranks, model)?;
            check_fits(prompt_ids.len(), 0, context(&dir)?)?;
            let mut state = m.new_state(prompt_ids.len())?;
            let logits = backend.to_f32(&m.forward(prompt_ids, &mut state, Logits::All)?)?;
            let shape = vec![prompt_ids.len(), m.spec().vocab];
            let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes)?;
            safetensors::serialize_to_file([("logits", view)], None, out)?;
            Ok(())
        }
        Command::Generate { model, prompt, prompt_ids, max_new_tokens, sample, json, speculative_tokens, drafter } => {
            let (mut m, dir) = load(ranks, model)?;
            keep_mtp_for(&mut m, *speculative_tokens, *drafter);
            let spec = (*speculative_tokens, drafter.kind());
            let ctx = context(&dir)?;
            let mut opts = vt::GenerateOptions {
                max_new_tokens: *max_new_tokens,
                sampling: sample.params(),
                stop_token_ids: vec![],
            };
            let (g, text) = match (prompt, prompt_ids) {
                (Some(text), _) => {
                    let tok = tokenizer(&dir)?;
                    opts.stop_token_ids = stop_ids(&m, &tok);
                    let ids = tok.encode(text, true)?;
                    check_fits(ids.len(), *max_new_tokens, ctx)?;
                    let mut out = std::io::stdout();
                    let mut detok = Detokenizer::new();
                    let mut all = text.clone();
                    print!("{text}");
                    let g = generate(m, &ids, &opts, spec, |id| {
                        let delta = detok.push(&tok, id).unwrap_or_default();
                        all.push_str(&delta);
                        print!("{delta}");
                        let _ = out.flush();
                        ControlFlow::Continue(())
                    })?;
                    let rest = detok.finish(&tok)?;
                    println!("{rest}");
                    (g, Some(all + &rest))
                }
                (None, Some(ids)) => {
                    check_fits(ids.len(), *max_new_tokens, ctx)?;
                    let g = generate(m, ids, &opts, spec, |_| ControlFlow::Continue(()))?;
                    if !json {
                        println!("{}", g.token_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
                    }
                    (g, None)
                }
                (None, None) => return Err("give --prompt or --prompt-ids".into()),
            };
            let decode_steps = g.token_ids.len().saturating_sub(1).max(1);
            let ms_per_token = g.decode_time.as_secs_f64() * 1e3 / decode_steps as f64;
            if *json {
                let obj = serde_json::json!({
                    "token_ids": g.token_ids,
                    "text": text,
                    "prefill_ms": g.prefill_time.as_secs_f64() * 1e3,
                    "decode_ms_per_token": ms_per_token,
                    "drafts_proposed": g.drafts.0,
                    "drafts_accepted": g.drafts.1,
                });
                println!("{obj}");
            } else {
                let drafts = match g.drafts {
                    (0, _) => String::new(),
                    (d, a) => format!("; drafts accepted {a} of {d} ({:.1}%)", 100.0 * a as f64 / d as f64),
                };
                eprintln!(
                    "prefill {:.1} ms, decode {:.2} ms/token{drafts}",
                    g.prefill_time.as_secs_f64() * 1e3,
                    ms_per_token
                );
            }
            Ok(())
        }
        Command::Chat { model, max_new_tokens, sample } => {
            let (m, dir) = load(ranks, model)?;
            let tok = tokenizer(&dir)?;
            let opts = vt::GenerateOptions {
                max_new_tokens: *max_new_tokens,
                sampling: sample.params(),
                stop_token_ids: stop_ids(&m, &tok),
            };
            chat::run(&m, &tok, opts, context(&dir)?)
        }
        Command::Serve { model, serve, engine, agent } => {
            let (mut m, dir) = load(ranks, model)?;
            keep_mtp_for(&mut m, engine.speculative_tokens, engine.drafter);
            let ctx = context(&dir)?;
            let max_context = match engine.max_model_len {
                Some(n) if n > ctx => {
                    return Err(format!("--max-model-len {n} passes the model's context of {ctx} tokens").into())
                }
                Some(n) => n,
                None => ctx,
            };
            let config = EngineConfig {
                max_seqs: engine.max_seqs,
                max_batch_tokens: engine.max_batch_tokens,
                max_queue: engine.max_queue,
                memory_budget: engine.memory_budget_mib.map(|mb| mb << 20),
                gpu_memory_utilization: engine.gpu_memory_utilization,
                max_context,
                prefix_cache: !engine.no_prefix_cache,
                speculative_tokens: engine.speculative_tokens,
                drafter: engine.drafter.kind(),
            };
            let name = serve.served_model_name.clone().unwrap_or_else(|| {
                let dir = dir.canonicalize().unwrap_or(dir.clone());
                dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned())
            });
            let engine = EngineHandle::spawn(m, config).map_err(|e| format!("the sequence-state pool: {e}"))?;
            // Responses are text: without a tokenizer they would be empty.
            let mut tok = Tokenizer::load(&dir)?
                .ok_or_else(|| format!("{} has no tokenizer.json, which serving needs", dir.display()))?;
            if let Some(path) = &agent.chat_template {
                tok.set_chat_template(std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?);
            }
            let mut state = server::AppState::new(engine, Some(tok), name);
            if let Some(name) = &agent.tool_call_parser {
                state.agent.tool_format = vt::tool_parser::ToolFormat::from_name(name)
                    .ok_or_else(|| format!("--tool-call-parser {name}: not one of qwen3_xml, hermes, laguna"))?;
            }
            state.agent.reasoning = agent.reasoning_parser == "think";
            state.agent.special_tokens_in_messages = agent.special_tokens_in_messages;
            state.sampling = SamplingParams::from_generation_config(&dir, state.sampling.clone())?;
            state.chat_max_tokens = serve.default_max_tokens;
            serve_api(Arc::new(state), serve)
        }
        Command::Bench {
            model,
            batch,
            prompt_len,
            gen_len,
            load_format,
            num_layers,
            unrecorded,
            json_schema,
            gpu_memory_utilization,
            shared_prefix,
            conversations,
            turns,
            no_prefix_cache,
            hold_context,
            speculative_tokens,
        } => {
            let dir = model_dir(model.model.as_deref())?;
            let speculates = shared_prefix.is_none() && hold_context.is_none() && *speculative_tokens > 0;
            let mut m = bench::load(ranks, &dir, *load_format, *num_layers, speculates)?;
            m.set_recorded_decode(!*unrecorded);
            if let Some(prefix_len) = *shared_prefix {
                let w = bench::MultiTurn {
                    prefix_len,
                    conversations: *conversations,
                    turns: *turns,
                    message_len: *prompt_len,
                    gen_len: *gen_len,
                    max_batch_tokens: 8192,
                    gpu_memory_utilization: *gpu_memory_utilization,
                };
                bench::run_multi_turn(m, &w, !no_prefix_cache)?;
                return Ok(());
            }
            if let Some(context) = *hold_context {
                let w = bench::Hold {
                    context,
                    seqs: batch.first().copied().unwrap_or(1),
                    gen_len: *gen_len,
                    gpu_memory_utilization: *gpu_memory_utilization,
                    prefix_cache: !no_prefix_cache,
                };
                bench::run_hold(m, &w)?;
                return Ok(());
            }
            let bandwidth = match model.backend {
                BackendKind::Cpu => bench::host_copy_bandwidth(),
                BackendKind::Cuda | BackendKind::Wgpu => bench::copy_bandwidth(backend)?,
            };
            let constraint = match json_schema {
                None => None,
                Some(path) => Some(bench::constraint(&dir, path, m.spec().vocab)?),
            };
            let shape = bench::Shape {
                batch: batch.clone(),
                prompt_len: *prompt_len,
                gen_len: *gen_len,
                constraint,
                gpu_memory_utilization: *gpu_memory_utilization,
                speculative_tokens: *speculative_tokens,
            };
            bench::run(backend, m, &shape, bandwidth)?;
            Ok(())
        }
    }
}

/// Generates for one prompt: alone, or through an engine of one sequence where it speculates
/// (`spec`: the tokens drafted per step, and by what).
fn generate<B: Backend>(
    m: Model<B>,
    ids: &[u32],
    opts: &vt::GenerateOptions,
    spec: (usize, vt::DrafterKind),
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> AnyResult<vt::Generation>
where
    Model<B>: Send,
{
    Ok(match spec {
        (0, _) => vt::generate_with(&m, ids, opts, on_token)?,
        (k, drafter) => vt::generate_speculative(m, ids, opts, k, drafter, on_token)?,
    })
}

/// Serves `state` as `args` say until SIGINT or SIGTERM, logging with `tracing` (`RUST_LOG`).
fn serve_api(state: Arc<server::AppState>, args: &ServeArgs) -> AnyResult<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).try_init();
    let addr = (args.host.as_str(), args.port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| format!("--host {}: no address", args.host))?;
    if !addr.ip().is_loopback() && args.api_key.is_none() {
        tracing::warn!("serving on {addr}, beyond this machine, without --api-key: anyone who reaches it can use it");
    }
    // Each connection holds a descriptor: raise the soft limit to fit, where the hard one allows.
    let fds = rlimit::increase_nofile_limit((args.max_connections + 64) as u64).unwrap_or(0);
    let mut max_connections = args.max_connections;
    if fds > 0 && fds < (max_connections + 64) as u64 {
        max_connections = (fds as usize).saturating_sub(64).max(1);
        tracing::warn!(
            "--max-connections {}: the file-descriptor limit is {fds}; using {max_connections}",
            args.max_connections
        );
    }
    let secs = |n: usize| Duration::from_secs(n as u64);
    let config = ServerConfig {
        transport: Transport {
            header_timeout: secs(args.header_timeout_secs),
            max_connections,
            drain_timeout: secs(args.drain_timeout_secs),
        },
        body: BodyLimits { max_bytes: args.max_body_mib << 20, timeout: secs(args.body_timeout_secs) },
        api_key: args.api_key.clone(),
        allowed_origins: args.allowed_origins.clone(),
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!("serving {} on http://{}", state.model_id, listener.local_addr()?);
        server::serve_with(listener, state, &config, server::shutdown_signal()).await
    })?;
    Ok(())
}
