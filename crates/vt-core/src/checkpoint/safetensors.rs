//! Memory-mapped safetensors files, single or sharded, validated before any tensor is read.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::{DType, Error, Result};

/// One tensor of a checkpoint, borrowed from the mapped file in its stored dtype.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorRef<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Decodes a float tensor to f32 (small tensors only: norms, biases, reference data).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        if !self.dtype.is_float() {
            return Err(Error::tensor(self.name, format!("expected a float tensor, found {}", self.dtype)));
        }
        let mut out = vec![0.0; self.numel()];
        crate::dtype::decode_into(self.dtype, self.bytes, &mut out);
        Ok(out)
    }

    /// Reads an I64 tensor (token ids in reference files).
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        if self.dtype != DType::I64 {
            return Err(Error::tensor(self.name, format!("expected I64, found {}", self.dtype)));
        }
        Ok(self.bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk"))).collect())
    }
}

struct Entry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Absolute byte range in the mapped file.
    start: usize,
    end: usize,
}

/// The safetensors files of a checkpoint and the name -> location index over all of them.
pub struct TensorStore {
    files: Vec<(PathBuf, Mmap)>,
    entries: HashMap<String, Entry>,
    dir: PathBuf,
}

impl TensorStore {
    /// Opens `model.safetensors`, or the shards listed by `model.safetensors.index.json`, or every
    /// `*.safetensors` file in `dir` (sorted) when neither is present.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths = if index.exists() {
            shard_paths(&index)?
        } else if single.exists() {
            vec![single]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(Error::Io {
                    path: dir.to_path_buf(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors files"),
                });
            }
            found
        };
        Self::open_files(dir, &paths)
    }

    pub fn open_files(dir: &Path, paths: &[PathBuf]) -> Result<Self> {
        let mut store = TensorStore { files: Vec::new(), entries: HashMap::new(), dir: dir.to_path_buf() };
        for path in paths {
            store.add_file(path)?;
        }
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        // SAFETY: the map is read-only and lives as long as the store. Checkpoint files are not
        // expected to change while mapped; if one is truncated underneath us the process may get
        // SIGBUS, which is the documented hazard of reading weights through mmap.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let bad = |reason: String| Error::Safetensors { path: path.to_path_buf(), reason };
        let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| bad(e.to_string()))?;
        let data_start = 8 + header_len;
        let file_idx = self.files.len();
        for (name, info) in metadata.tensors() {
            let dtype = map_dtype(info.dtype)
                .ok_or_else(|| bad(format!("tensor `{name}` has unsupported dtype {:?}", info.dtype)))?;
            let (s, e) = info.data_offsets;
            let entry =
                Entry { file: file_idx, dtype, shape: info.shape.clone(), start: data_start + s, end: data_start + e };
            if entry.end > mmap.len() || entry.start > entry.end {
                return Err(bad(format!("tensor `{name}` data offsets out of range")));
            }
            if self.entries.insert(name.clone(), entry).is_some() {
                return Err(bad(format!("tensor `{name}` appears in more than one file")));
            }
        }
        self.files.push((path.to_path_buf(), mmap));
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        let (key, e) = self
            .entries
            .get_key_value(name)
            .ok_or_else(|| Error::MissingTensor { name: name.to_string(), dir: self.dir.clone() })?;
        Ok(TensorRef { name: key, dtype: e.dtype, shape: &e.shape, bytes: &self.files[e.file].1[e.start..e.end] })
    }

    /// Bytes of all mapped files.
    pub fn total_bytes(&self) -> usize {
        self.files.iter().map(|(_, m)| m.len()).sum()
    }
}

fn shard_paths(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io { path: index.to_path_buf(), source })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| Error::Json { path: index.to_path_buf(), source })?;
    let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::Config {
        file: index.to_path_buf(),
        field: "weight_map".into(),
        reason: "missing or not an object".into(),
    })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| Error::Config {
            file: index.to_path_buf(),
            field: format!("weight_map.{tensor}"),
            reason: "expected a file name".into(),
        })?;
        if file.contains('/') || file.contains("..") {
            return Err(Error::Config {
                file: index.to_path_buf(),
                field: format!("weight_map.{tensor}"),
                reason: format!("shard `{file}` is not a plain file name"),
            });
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn map_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::F8_E4M3 => DType::F8E4M3,
        StDtype::U8 => DType::U8,
        StDtype::I64 => DType::I64,
        _ => return None,
    })
}
