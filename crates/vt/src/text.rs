//! Text in and out: `tokenizer.json` through the `tokenizers` crate, chat templates from
//! `tokenizer_config.json` (rendered by [`crate::chat`]), and incremental detokenisation that
//! streams only whole characters and holds back text that may turn out to be a stop string.
//!
//! Chat prompts keep control tokens to the template: a special token's text typed in a message
//! is tokenized as plain text unless the caller allows it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use vt_core::{Error, Result};

use crate::chat::{self, ChatInput};

/// One chat message, as in OpenAI's API and Hugging Face chat templates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A checkpoint's tokenizer and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens' text encoded as plain text.
    plain: tokenizers::Tokenizer,
    /// The text of each special token, longest first (so a longer one is matched before its prefix).
    specials: Vec<String>,
    chat_template: Option<String>,
    /// `tokenizer.json` as read, for the grammar engine's own view of the vocabulary.
    json: Vec<u8>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn text_err(what: impl std::fmt::Display) -> Error {
    Error::input(format!("tokenizer: {what}"))
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn special_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content")?.as_str().map(str::to_string),
    }
}

impl Tokenizer {
    /// Reads `tokenizer.json` and, when present, `tokenizer_config.json` and `chat_template.jinja`
    /// from a checkpoint directory. `Ok(None)` when the directory has no `tokenizer.json`.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let json = std::fs::read(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&json).map_err(|e| text_err(format!("{}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(s) => serde_json::from_str(&s).map_err(|e| text_err(format!("{}: {e}", cfg_path.display())))?,
            Err(_) => serde_json::Value::Null,
        };
        let chat_template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => match cfg.get("chat_template") {
                Some(serde_json::Value::String(t)) => Some(t.clone()),
                // A list of named templates: use "default".
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(str::to_string),
                _ => None,
            },
        };
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let mut specials: Vec<String> =
            inner.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        specials.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        specials.dedup();
        Ok(Some(Tokenizer {
            inner,
            plain,
            specials,
            chat_template,
            json,
            bos_token: special_token(&cfg, "bos_token"),
            eos_token: special_token(&cfg, "eos_token"),
        }))
    }

    /// Token ids of `text`; `special` adds what the tokenizer's post-processor adds (e.g. BOS).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, special).map_err(text_err)?.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(text_err)
    }

    /// The text of one token alone, special tokens included (a piece of a character decodes
    /// to U+FFFD), as logprobs report it.
    pub fn decode_token(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The id of the configured EOS token, if it is in the vocabulary.
    pub fn eos_id(&self) -> Option<u32> {
        self.token_id(self.eos_token.as_deref()?)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Uses `template` instead of the checkpoint's chat template.
    pub fn set_chat_template(&mut self, template: String) {
        self.chat_template = Some(template);
    }

    /// The grammar engine's index of this vocabulary (`vocab`: the model's logits width; `stop`:
    /// the ids that end a sequence).
    pub fn grammar_compiler(&self, stop: &[u32], vocab: usize) -> Result<crate::grammar::GrammarCompiler> {
        crate::grammar::GrammarCompiler::new(&self.json, stop, vocab)
    }

    /// Renders the chat template for plain text messages, as transformers'
    /// `apply_chat_template(tokenize=False)`.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let messages: Vec<Value> = messages.iter().map(|m| serde_json::json!(m)).collect();
        let kwargs = serde_json::Map::new();
        self.render_chat(&ChatInput {
            messages: &messages,
            tools: None,
            add_generation_prompt,
            continue_final_message: false,
            kwargs: &kwargs,
        })
    }

    /// Renders the chat template for `input`, as transformers' `apply_chat_template(tokenize=False)`.
    pub fn render_chat(&self, input: &ChatInput) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| text_err("this model has no chat template"))?;
        let (bos, eos) = (self.bos_token.as_deref().unwrap_or_default(), self.eos_token.as_deref().unwrap_or_default());
        chat::render(template, bos, eos, input)
    }

    /// The prompt's token ids for `input`. Special tokens' text inside the caller's strings
    /// (messages, tools, template kwargs) is tokenized as plain text unless `allow_special`; only
    /// the template's own markers become control tokens.
    pub fn encode_chat(&self, input: &ChatInput, allow_special: bool) -> Result<Vec<u32>> {
        Ok(self.chat_prompt(input, allow_special)?.ids)
    }

    /// `encode_chat`, with the rendered text.
    pub fn chat_prompt(&self, input: &ChatInput, allow_special: bool) -> Result<ChatPrompt> {
        if allow_special {
            let text = self.render_chat(input)?;
            return Ok(ChatPrompt { ids: self.encode(&text, false)?, text });
        }
        let messages: Vec<Value> = input.messages.iter().map(|v| self.escape_specials(v)).collect();
        let tools: Option<Vec<Value>> = input.tools.map(|t| t.iter().map(|v| self.escape_specials(v)).collect());
        let kwargs = match self.escape_specials(&Value::Object(input.kwargs.clone())) {
            Value::Object(m) => m,
            _ => unreachable!("an object stays an object"),
        };
        let text =
            self.render_chat(&ChatInput { messages: &messages, tools: tools.as_deref(), kwargs: &kwargs, ..*input })?;
        let mut ids = Vec::new();
        let mut plain_text = String::with_capacity(text.len());
        for (i, part) in text.split(ESCAPE_OPEN).enumerate() {
            // Every part after the first starts with an escaped special token's index.
            let (escaped, rest) = match (i, part.split_once(ESCAPE_CLOSE)) {
                (0, _) | (_, None) => (None, part),
                (_, Some((k, rest))) => (k.parse::<usize>().ok().and_then(|k| self.escaped(k)), rest),
            };
            if let Some(escaped) = escaped {
                ids.extend(self.plain.encode(escaped, false).map_err(text_err)?.get_ids());
                plain_text.push_str(escaped);
            }
            if !rest.is_empty() {
                ids.extend(self.encode(rest, false)?);
                plain_text.push_str(rest);
            }
        }
        Ok(ChatPrompt { text: plain_text, ids })
    }

    /// The text escape `k` stands for: a special token, or (past them) the escape character itself.
    fn escaped(&self, k: usize) -> Option<&str> {
        const OPEN: &str = "\u{F0000}";
        self.specials.get(k).map(String::as_str).or((k == self.specials.len()).then_some(OPEN))
    }

    /// `v` with every special token's text (and the escape character) in its strings replaced by
    /// an escape naming it.
    fn escape_specials(&self, v: &Value) -> Value {
        let escapable = |s: &str| (0..=self.specials.len()).any(|k| self.escaped(k).is_some_and(|t| s.contains(t)));
        match v {
            Value::String(s) if escapable(s) => {
                let mut out = String::with_capacity(s.len());
                let mut rest = s.as_str();
                while !rest.is_empty() {
                    let hit = (0..=self.specials.len())
                        .find_map(|k| self.escaped(k).filter(|t| rest.starts_with(t)).map(|t| (k, t)));
                    match hit {
                        Some((k, t)) => {
                            out.push_str(&format!("{ESCAPE_OPEN}{k}{ESCAPE_CLOSE}"));
                            rest = &rest[t.len()..];
                        }
                        None => {
                            let c = rest.chars().next().expect("not empty");
                            out.push(c);
                            rest = &rest[c.len_utf8()..];
                        }
                    }
                }
                Value::String(out)
            }
            Value::Array(items) => Value::Array(items.iter().map(|x| self.escape_specials(x)).collect()),
            Value::Object(map) => {
                Value::Object(map.iter().map(|(k, x)| (k.clone(), self.escape_specials(x))).collect())
            }
            other => other.clone(),
        }
    }
}

/// A rendered chat prompt and its token ids.
pub struct ChatPrompt {
    pub text: String,
    pub ids: Vec<u32>,
}

/// Brackets of an escaped special token in a rendered prompt (private-use characters: text
/// that contains them anyway can only produce more plain-text tokens).
const ESCAPE_OPEN: char = '\u{F0000}';
const ESCAPE_CLOSE: char = '\u{F0001}';

/// Turns generated ids into text deltas one token at a time.
///
/// Decoding a token alone is wrong for byte-level BPE (a character can span tokens, and some
/// tokenizers' decoders depend on context), so it decodes a short window and emits the new text
/// only once it no longer ends in an incomplete character (U+FFFD), as TGI and vLLM do.
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the context window.
    prefix: usize,
    /// End of the already-emitted part.
    read: usize,
}

impl Detokenizer {
    pub fn new() -> Self {
        Detokenizer { ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// Text completed by `id` (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        match now.get(before.len()..) {
            Some(delta) if now.len() > before.len() && !now.ends_with('\u{FFFD}') => {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                Ok(delta)
            }
            _ => Ok(String::new()),
        }
    }

    /// Whatever is still held back (an incomplete character at the very end decodes lossily).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

impl Default for Detokenizer {
    fn default() -> Self {
        Self::new()
    }
}

/// Cuts streamed text at the first stop string, holding back any tail that could begin one.
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new() }
    }

    /// Adds `delta`; returns the text that is safe to emit and whether a stop string was reached
    /// (the stop string itself is not emitted).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        self.pending.push_str(delta);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        let hold = self.stops.iter().map(|s| longest_prefix_suffix(&self.pending, s)).max().unwrap_or(0);
        let out = self.pending[..self.pending.len() - hold].to_string();
        self.pending.drain(..self.pending.len() - hold);
        (out, false)
    }

    /// The held-back tail, once no more text is coming.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len()).rev().find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut s = StopStrings::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(s.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(s.push("N"), (String::new(), false));
        assert_eq!(s.push("x"), ("ENx".to_string(), false));
        assert_eq!(s.push("y\n"), ("y".to_string(), false));
        assert_eq!(s.push("\nmore"), (String::new(), true));
        let mut s = StopStrings::new(vec!["é!".into()]);
        assert_eq!(s.push("aé"), ("a".to_string(), false));
        assert_eq!(s.finish(), "é");
    }
}
