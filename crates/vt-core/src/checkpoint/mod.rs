//! Reading Hugging Face checkpoints: `config.json` and memory-mapped safetensors.

mod config;
mod safetensors;

use std::path::{Path, PathBuf};

pub use config::Config;
pub use safetensors::{TensorRef, TensorStore};

use crate::Result;

/// A checkpoint directory: its config and its tensors, still in their stored dtypes.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Config,
    pub tensors: TensorStore,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let tensors = TensorStore::open_dir(dir)?;
        Ok(Checkpoint { dir: dir.to_path_buf(), config, tensors })
    }
}
