//! What the formats' config readers share: config fields located for errors, list entries kept
//! as written, checked checkpoint tensors.

use std::path::Path;

use serde_json::Value;
use vt_core::checkpoint::TensorRef;
use vt_core::{DType, Error, Result};

use super::pattern::Pattern;

/// One entry of a config list, kept as written for error messages.
#[derive(Debug)]
pub(super) struct Rule {
    pub field: String,
    pub text: String,
    pub pattern: Pattern,
}

pub(super) fn expect_tensor(t: &TensorRef, dtype: DType, shape: &[usize], what: &str) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(Error::tensor(
            t.name,
            format!("expected {dtype} {shape:?} ({what}), found {} {:?}", t.dtype, t.shape),
        ));
    }
    Ok(())
}

/// Where in which file a config value sits, for errors.
#[derive(Clone)]
pub(super) struct Ctx<'a> {
    file: &'a Path,
    base: String,
}

impl<'a> Ctx<'a> {
    pub(super) fn new(file: &'a Path, base: &str) -> Self {
        Ctx { file, base: base.to_string() }
    }

    pub(super) fn field(&self, f: &str) -> String {
        if self.base.is_empty() {
            f.to_string()
        } else {
            format!("{}.{f}", self.base)
        }
    }

    pub(super) fn sub(&self, f: &str) -> Ctx<'a> {
        Ctx { file: self.file, base: self.field(f) }
    }

    pub(super) fn err(&self, f: &str, reason: impl Into<String>) -> Error {
        Error::Config { file: self.file.to_path_buf(), field: self.field(f), reason: reason.into() }
    }

    /// An optional string field (`null` counts as absent).
    pub(super) fn opt_str<'v>(&self, v: &'v Value, f: &str) -> Result<Option<&'v str>> {
        match v.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.err(f, format!("expected a string, found {other}"))),
        }
    }

    /// An optional list of strings, each with its field name (`f[i]`).
    pub(super) fn str_list(&self, v: &Value, f: &str) -> Result<Vec<(String, String)>> {
        let items = match v.get(f) {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(items)) => items,
            Some(other) => return Err(self.err(f, format!("expected a list of strings, found {other}"))),
        };
        items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let field = format!("{f}[{i}]");
                x.as_str()
                    .map(|s| (self.field(&field), s.to_string()))
                    .ok_or_else(|| self.err(&field, format!("expected a string, found {x}")))
            })
            .collect()
    }

    /// `f` must be `want` (or, unless `required`, absent).
    pub(super) fn expect(&self, v: &Value, f: &str, want: Value, required: bool) -> Result<()> {
        match v.get(f) {
            Some(x) if *x == want => Ok(()),
            None | Some(Value::Null) if !required => Ok(()),
            None | Some(Value::Null) => Err(self.err(f, format!("missing (vt reads {want})"))),
            Some(x) => Err(self.err(f, format!("{x} is not supported (vt reads {want})"))),
        }
    }

    /// A list entry read by `parse` (an error names the entry's field).
    pub(super) fn rule(
        &self,
        (field, text): (String, String),
        parse: impl FnOnce(&str) -> std::result::Result<Pattern, String>,
    ) -> Result<Rule> {
        let pattern = parse(&text).map_err(|e| Error::Config {
            file: self.file.to_path_buf(),
            field: field.clone(),
            reason: format!("pattern `{text}`: {e}"),
        })?;
        Ok(Rule { field, text, pattern })
    }
}
