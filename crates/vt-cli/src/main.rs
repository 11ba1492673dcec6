//! `vt`: run MoE language models from Hugging Face checkpoints.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use vt::{Backend, Logits, Model};

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
    /// Comma-separated prompt token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    prompt_ids: Vec<u32>,
}

#[derive(Subcommand)]
enum Command {
    /// Write the logits of every prompt position to a safetensors file (tensor `logits`, f32).
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        out: PathBuf,
    },
    /// Generate a continuation of the prompt.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 32)]
        max_new_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print a JSON object as the last line of stdout.
        #[arg(long)]
        json: bool,
    },
}

/// The built-in default model, used when `--model` is omitted.
fn default_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen35moe_nested")
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

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let args = match &cli.command {
        Command::Logits { model, .. } | Command::Generate { model, .. } => model,
    };
    match args.backend {
        BackendKind::Cpu => run_on(&vt::CpuBackend::new(), &cli),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => run_on(&vt::CudaBackend::new()?, &cli),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err("this build has no CUDA backend (build vt with --features cuda)".into()),
    }
}

fn run_on<B: Backend>(backend: &B, cli: &Cli) -> Result<(), Box<dyn std::error::Error>> {
    match &cli.command {
        Command::Logits { model, out } => {
            let m = Model::load(backend, &model.model.clone().unwrap_or_else(default_model))?;
            let mut state = m.new_state()?;
            let logits = backend.to_f32(&m.forward(&model.prompt_ids, &mut state, Logits::All)?)?;
            let shape = vec![model.prompt_ids.len(), m.spec().vocab];
            let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes)?;
            safetensors::serialize_to_file([("logits", view)], None, out)?;
            Ok(())
        }
        Command::Generate { model, max_new_tokens, temperature, seed, json } => {
            let m = Model::load(backend, &model.model.clone().unwrap_or_else(default_model))?;
            let opts = vt::GenerateOptions {
                max_new_tokens: *max_new_tokens,
                sampling: vt::SamplingParams { temperature: *temperature, seed: *seed, ..Default::default() },
                stop_token_ids: Vec::new(),
            };
            let g = vt::generate(&m, &model.prompt_ids, &opts)?;
            let decode_steps = g.token_ids.len().saturating_sub(1).max(1);
            let ms_per_token = g.decode_time.as_secs_f64() * 1e3 / decode_steps as f64;
            if *json {
                let obj = serde_json::json!({
                    "token_ids": g.token_ids,
                    "prefill_ms": g.prefill_time.as_secs_f64() * 1e3,
                    "decode_ms_per_token": ms_per_token,
                });
                println!("{obj}");
            } else {
                println!("{}", g.token_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
                eprintln!("prefill {:.1} ms, decode {:.2} ms/token", g.prefill_time.as_secs_f64() * 1e3, ms_per_token);
            }
            Ok(())
        }
    }
}
