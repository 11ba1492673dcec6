//! `config.json`, with the text model's fields possibly nested under `text_config`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, Result};

/// A model's `config.json`. Field lookups read the text config (`text_config` when present) first,
/// then the top level, and every error names the file and the field.
#[derive(Clone, Debug)]
pub struct Config {
    path: PathBuf,
    root: Value,
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Self::from_str(path, &text)
    }

    /// Parses JSON text; `path` is what errors will name.
    pub fn from_str(path: &Path, text: &str) -> Result<Self> {
        let root: Value =
            serde_json::from_str(text).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
        if !root.is_object() {
            return Err(Error::Config {
                file: path.to_path_buf(),
                field: "<root>".into(),
                reason: "expected a JSON object".into(),
            });
        }
        Ok(Config { path: path.to_path_buf(), root })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole document (for sections such as `quantization_config`).
    pub fn root(&self) -> &Value {
        &self.root
    }

    fn text(&self) -> Option<&Value> {
        self.root.get("text_config").filter(|v| v.is_object())
    }

    /// The top-level `model_type` (a nested config's outer type, e.g. `qwen3_5_moe`).
    pub fn model_type(&self) -> Result<&str> {
        self.root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| self.error("model_type", "missing or not a string"))
    }

    /// The raw value of `field`: text config first, then the top level.
    pub fn get(&self, field: &str) -> Option<&Value> {
        self.text()
            .and_then(|t| t.get(field))
            .filter(|v| !v.is_null())
            .or_else(|| self.root.get(field).filter(|v| !v.is_null()))
    }

    pub fn error(&self, field: &str, reason: impl Into<String>) -> Error {
        Error::Config { file: self.path.clone(), field: field.to_string(), reason: reason.into() }
    }

    fn required(&self, field: &str) -> Result<&Value> {
        self.get(field).ok_or_else(|| self.error(field, "missing"))
    }

    pub fn usize(&self, field: &str) -> Result<usize> {
        let v = self.required(field)?;
        as_usize(v).ok_or_else(|| self.error(field, format!("expected a non-negative integer, found {v}")))
    }

    pub fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        self.get(field).is_some().then(|| self.usize(field)).transpose()
    }

    pub fn f64(&self, field: &str) -> Result<f64> {
        let v = self.required(field)?;
        v.as_f64().ok_or_else(|| self.error(field, format!("expected a number, found {v}")))
    }

    pub fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        self.get(field).is_some().then(|| self.f64(field)).transpose()
    }

    pub fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.error(field, format!("expected true or false, found {v}"))),
        }
    }

    pub fn str(&self, field: &str) -> Result<&str> {
        let v = self.required(field)?;
        v.as_str().ok_or_else(|| self.error(field, format!("expected a string, found {v}")))
    }

    pub fn opt_str(&self, field: &str) -> Result<Option<&str>> {
        self.get(field).is_some().then(|| self.str(field)).transpose()
    }

    pub fn opt_usize_list(&self, field: &str) -> Result<Option<Vec<usize>>> {
        let Some(v) = self.get(field) else { return Ok(None) };
        let items = v.as_array().ok_or_else(|| self.error(field, format!("expected a list, found {v}")))?;
        items
            .iter()
            .map(|x| as_usize(x).ok_or_else(|| self.error(field, format!("expected non-negative integers, found {x}"))))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn opt_str_list(&self, field: &str) -> Result<Option<Vec<String>>> {
        let Some(v) = self.get(field) else { return Ok(None) };
        let items = v.as_array().ok_or_else(|| self.error(field, format!("expected a list, found {v}")))?;
        items
            .iter()
            .map(|x| {
                x.as_str().map(str::to_string).ok_or_else(|| self.error(field, format!("expected strings, found {x}")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|n| usize::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_text_config_wins_and_falls_back_to_root() {
        let c = Config::from_str(
            Path::new("config.json"),
            r#"{"model_type":"outer","tie_word_embeddings":true,"text_config":{"hidden_size":64,"model_type":"inner"}}"#,
        )
        .unwrap();
        assert_eq!(c.model_type().unwrap(), "outer");
        assert_eq!(c.usize("hidden_size").unwrap(), 64);
        assert!(c.bool_or("tie_word_embeddings", false).unwrap());
        assert_eq!(c.str("model_type").unwrap(), "inner");
    }

    #[test]
    fn errors_name_file_and_field() {
        let c = Config::from_str(Path::new("/m/config.json"), r#"{"hidden_size":"big"}"#).unwrap();
        let e = c.usize("hidden_size").unwrap_err().to_string();
        assert!(e.contains("/m/config.json") && e.contains("hidden_size"), "{e}");
        let e = c.usize("num_hidden_layers").unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers") && e.contains("missing"), "{e}");
        assert!(Config::from_str(Path::new("x.json"), "{not json").unwrap_err().to_string().contains("x.json"));
    }
}
