//! The built-in model (`models/default`, trained by tools/train_default), compiled into the
//! binary so an installed or copied `vt` has it. It is small (~7 MiB); at first use its files are
//! written to the user's cache directory, where the loader (which maps files) reads them.

use std::fs;
use std::path::{Path, PathBuf};

macro_rules! file {
    ($name:literal) => {
        ($name, include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default/", $name)).as_slice())
    };
}

const FILES: [(&str, &[u8]); 5] = [
    file!("config.json"),
    file!("generation_config.json"),
    file!("model.safetensors"),
    file!("tokenizer.json"),
    file!("tokenizer_config.json"),
];

/// The directory holding the built-in model's files, written there if missing or different.
pub fn model_dir() -> std::io::Result<PathBuf> {
    let dir = cache_root().join(format!("vt/builtin-{}-{:016x}", env!("CARGO_PKG_VERSION"), fingerprint()));
    if !matches(&dir) {
        // Written beside, then renamed into place: a concurrent `vt` never sees a partial model.
        let staging = dir.with_extension(format!("tmp{}", std::process::id()));
        fs::create_dir_all(&staging)?;
        for (name, bytes) in FILES {
            fs::write(staging.join(name), bytes)?;
        }
        let _ = fs::remove_dir_all(&dir);
        if fs::rename(&staging, &dir).is_err() && !matches(&dir) {
            return Err(std::io::Error::other(format!("could not place the built-in model at {}", dir.display())));
        }
        let _ = fs::remove_dir_all(&staging);
    }
    Ok(dir)
}

/// `$XDG_CACHE_HOME`, `~/.cache`, or the temporary directory.
fn cache_root() -> PathBuf {
    let env = |k| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache"))).unwrap_or_else(std::env::temp_dir)
}

/// Whether `dir` holds exactly the embedded files (whatever put them there).
fn matches(dir: &Path) -> bool {
    FILES.iter().all(|(name, bytes)| fs::read(dir.join(name)).is_ok_and(|b| b == *bytes))
}

/// FNV-1a over the embedded files: a rebuilt model gets a directory of its own.
fn fingerprint() -> u64 {
    FILES
        .iter()
        .flat_map(|(_, b)| b.iter())
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}
