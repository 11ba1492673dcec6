//! `--model OWNER/NAME`: a checkpoint on the Hugging Face hub, found in the local cache or
//! downloaded into it (hf-hub's blocking client; `HF_ENDPOINT` names another hub or a mirror).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;

/// Whether `model` names a hub repository: `owner/name`, not a path that exists.
pub fn is_hub_id(model: &str) -> bool {
    !Path::new(model).exists()
        && !model.starts_with(['/', '.', '~'])
        && model.split('/').filter(|p| !p.is_empty()).count() == 2
}

/// The snapshot directory of hub model `id` in the cache at `cache` (a Hugging Face hub cache,
/// `models--OWNER--NAME/snapshots/...`), downloading the checkpoint's files first if the cache
/// has none of it.
pub fn checkpoint_dir(id: &str, cache: &Path) -> Result<PathBuf, String> {
    let cached = hf_hub::Cache::new(cache.to_path_buf()).model(id.to_string()).get("config.json");
    if let Some(dir) = cached.as_deref().and_then(Path::parent) {
        return Ok(dir.to_path_buf());
    }
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
    let fail = |e: &dyn std::fmt::Display| {
        format!(
            "--model {id}: not a directory and not in the local Hugging Face cache at {}, and downloading it \
             from {endpoint} failed: {e} (without a network, fetch it elsewhere into that cache, e.g. \
             `hf download {id}`, or give a directory)",
            cache.display()
        )
    };
    let api = ApiBuilder::from_env()
        .with_endpoint(endpoint.clone())
        .with_cache_dir(cache.to_path_buf())
        .with_progress(std::io::stderr().is_terminal())
        .build()
        .map_err(|e| fail(&e))?;
    let repo = api.model(id.to_string());
    let info = repo.info().map_err(|e| fail(&e))?;
    let files: Vec<&str> =
        info.siblings.iter().map(|s| s.rfilename.as_str()).filter(|f| is_checkpoint_file(f)).collect();
    if !files.contains(&"config.json") {
        return Err(fail(&"the repository has no config.json"));
    }
    let mut dir = None;
    for f in files {
        eprintln!("downloading {id}/{f}");
        let path = repo.download(f).map_err(|e| fail(&format!("{f}: {e}")))?;
        if f == "config.json" {
            dir = path.parent().map(Path::to_path_buf);
        }
    }
    dir.ok_or_else(|| fail(&"config.json has no directory"))
}

/// The files vt reads from a checkpoint: configs, weights, tokenizer and chat template, at the
/// top of the repository (not its other formats, images or sub-models).
fn is_checkpoint_file(name: &str) -> bool {
    !name.contains('/') && [".json", ".safetensors", ".jinja"].iter().any(|ext| name.ends_with(ext))
}
