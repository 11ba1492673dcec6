//! `vt`: run MoE language models from Hugging Face checkpoints.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use vt::{Backend, ChatMessage, Detokenizer, EngineConfig, EngineHandle, Logits, Model, SamplingParams, Tokenizer};
use vt_cli::bench::{self, LoadFormat};
use vt_cli::server;

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
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Checkpoint directory (config.json + *.safetensors). Defaults to the built-in model.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
}

#[derive(clap::Args)]
struct SampleArgs {
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
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

#[derive(clap::Args)]
struct EngineArgs {
    /// Most sequences running at once.
    #[arg(long, default_value_t = 32)]
    max_seqs: usize,
    /// Most tokens per batched step (decodes plus prompt chunks).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Most requests waiting to start; more get 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Memory for sequence state (KV cache, linear-attention state), in MiB; unlimited if unset.
    #[arg(long)]
    memory_budget_mib: Option<usize>,
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
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        #[command(flatten)]
        sample: SampleArgs,
        /// Print a JSON object (`token_ids`: the generated ids) as the last line of stdout.
        #[arg(long)]
        json: bool,
    },
    /// Chat interactively through the model's chat template (one line per turn; empty line ends).
    Chat {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 256)]
        max_new_tokens: usize,
        #[command(flatten)]
        sample: SampleArgs,
    },
    /// Serve the OpenAI-compatible API.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8000)]
        port: u16,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        agent: AgentArgs,
    },
    /// Measure batched greedy generation throughput.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 32)]
        prompt_len: usize,
        #[arg(long, default_value_t = 32)]
        gen_len: usize,
        /// `dummy`: random weights at config.json's shapes (the directory needs only config.json).
        #[arg(long, value_enum, default_value = "auto")]
        load_format: LoadFormat,
        /// Keep only the first N layers (a cheaper run at full width).
        #[arg(long)]
        num_layers: Option<usize>,
        /// Decode without recorded steps (CUDA graphs): every op launched from the host.
        #[arg(long)]
        unrecorded: bool,
        /// Decode every sequence under this JSON schema (constrained decoding, masks computed
        /// on the CPU), to measure its cost against a run without it; needs tokenizer.json.
        #[arg(long)]
        json_schema: Option<PathBuf>,
    },
}

/// The built-in default model (`models/default`, trained by tools/train_default), used when
/// `--model` is omitted.
fn default_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/default")
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
    match args.backend {
        BackendKind::Cpu => run_on(&vt::CpuBackend::new(), &cli),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => run_on(&vt::CudaBackend::new()?, &cli),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err("this build has no CUDA backend (build vt with --features cuda)".into()),
    }
}

/// Loads the weights with a progress bar (bytes uploaded) on a terminal.
fn load<B: Backend>(backend: &B, args: &ModelArgs) -> AnyResult<(Model<B>, PathBuf)> {
    let dir = args.model.clone().unwrap_or_else(default_model);
    let bar = indicatif::ProgressBar::new(0)
        .with_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
                .expect("a valid template")
                .progress_chars("=> "),
        )
        .with_message(format!("loading {}", dir.display()));
    let model = Model::load_with_progress(backend, &dir, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    Ok((model?, dir))
}

fn tokenizer(dir: &Path) -> AnyResult<Tokenizer> {
    Tokenizer::load(dir)?
        .ok_or_else(|| format!("{} has no tokenizer.json; pass --prompt-ids instead", dir.display()).into())
}

fn stop_ids<B: Backend>(m: &Model<B>, tok: &Tokenizer) -> Vec<u32> {
    tok.eos_id().into_iter().chain(m.spec().eos_token_ids.iter().copied()).collect()
}

fn run_on<B: Backend>(backend: &B, cli: &Cli) -> AnyResult<()>
where
    Model<B>: Send,
{
    match &cli.command {
        Command::Logits { model, prompt_ids, out } => {
            let (m, _) = load(backend, model)?;
            let mut state = m.new_state()?;
            let logits = backend.to_f32(&m.forward(prompt_ids, &mut state, Logits::All)?)?;
            let shape = vec![prompt_ids.len(), m.spec().vocab];
            let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes)?;
            safetensors::serialize_to_file([("logits", view)], None, out)?;
            Ok(())
        }
        Command::Generate { model, prompt, prompt_ids, max_new_tokens, sample, json } => {
            let (m, dir) = load(backend, model)?;
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
                    let mut out = std::io::stdout();
                    let mut detok = Detokenizer::new();
                    let mut all = text.clone();
                    print!("{text}");
                    let g = vt::generate_with(&m, &ids, &opts, |id| {
                        let delta = detok.push(&tok, id).unwrap_or_default();
                        all.push_str(&delta);
                        print!("{delta}");
                        let _ = out.flush();
                    })?;
                    let rest = detok.finish(&tok)?;
                    println!("{rest}");
                    (g, Some(all + &rest))
                }
                (None, Some(ids)) => {
                    let g = vt::generate(&m, ids, &opts)?;
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
                });
                println!("{obj}");
            } else {
                eprintln!("prefill {:.1} ms, decode {:.2} ms/token", g.prefill_time.as_secs_f64() * 1e3, ms_per_token);
            }
            Ok(())
        }
        Command::Chat { model, max_new_tokens, sample } => {
            let (m, dir) = load(backend, model)?;
            let tok = tokenizer(&dir)?;
            let opts = vt::GenerateOptions {
                max_new_tokens: *max_new_tokens,
                sampling: sample.params(),
                stop_token_ids: stop_ids(&m, &tok),
            };
            let mut messages = Vec::new();
            let stdin = std::io::stdin();
            loop {
                eprint!("> ");
                let mut line = String::new();
                if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
                    return Ok(());
                }
                messages.push(ChatMessage { role: "user".into(), content: line.trim_end().to_string() });
                let ids = tok.encode(&tok.apply_chat_template(&messages, true)?, false)?;
                let mut detok = Detokenizer::new();
                let mut reply = String::new();
                vt::generate_with(&m, &ids, &opts, |id| {
                    let delta = detok.push(&tok, id).unwrap_or_default();
                    reply.push_str(&delta);
                    print!("{delta}");
                    let _ = std::io::stdout().flush();
                })?;
                reply.push_str(&detok.finish(&tok)?);
                println!();
                messages.push(ChatMessage { role: "assistant".into(), content: reply });
            }
        }
        Command::Serve { model, host, port, engine, agent } => {
            let (m, dir) = load(backend, model)?;
            let config = EngineConfig {
                max_seqs: engine.max_seqs,
                max_batch_tokens: engine.max_batch_tokens,
                max_queue: engine.max_queue,
                memory_budget: engine.memory_budget_mib.map(|mb| mb << 20),
                max_context: vt::context_limit(&dir)?.unwrap_or(4096),
            };
            let name = dir
                .canonicalize()
                .unwrap_or(dir.clone())
                .file_name()
                .map_or("model".into(), |n| n.to_string_lossy().into_owned());
            let mut tok = Tokenizer::load(&dir)?;
            if let (Some(t), Some(path)) = (tok.as_mut(), &agent.chat_template) {
                t.set_chat_template(std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?);
            }
            let mut state = server::AppState::new(EngineHandle::spawn(m, config), tok, name);
            if let Some(name) = &agent.tool_call_parser {
                state.agent.tool_format = vt::tool_parser::ToolFormat::from_name(name)
                    .ok_or_else(|| format!("--tool-call-parser {name}: not one of qwen3_xml, hermes, laguna"))?;
            }
            state.agent.reasoning = agent.reasoning_parser == "think";
            state.agent.special_tokens_in_messages = agent.special_tokens_in_messages;
            let state = Arc::new(state);
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async {
                let listener = tokio::net::TcpListener::bind((host.as_str(), *port)).await?;
                eprintln!("serving {} on http://{}", state.model_id, listener.local_addr()?);
                let shutdown = async {
                    let _ = tokio::signal::ctrl_c().await;
                    eprintln!("shutting down: finishing in-flight requests");
                };
                server::serve(listener, state, shutdown).await
            })?;
            Ok(())
        }
        Command::Bench { model, batch, prompt_len, gen_len, load_format, num_layers, unrecorded, json_schema } => {
            let dir = model.model.clone().unwrap_or_else(default_model);
            let mut m = bench::load(backend, &dir, *load_format, *num_layers)?;
            m.set_recorded_decode(!unrecorded);
            let bandwidth = match model.backend {
                BackendKind::Cpu => bench::host_copy_bandwidth(),
                BackendKind::Cuda => bench::copy_bandwidth(backend)?,
            };
            let constraint = match json_schema {
                None => None,
                Some(path) => Some(bench::constraint(&dir, path, m.spec().vocab)?),
            };
            let shape = bench::Shape { batch: batch.clone(), prompt_len: *prompt_len, gen_len: *gen_len, constraint };
            bench::run(backend, m, &shape, bandwidth)?;
            Ok(())
        }
    }
}
