//! Constrained decoding with llguidance: a JSON schema (or a Lark grammar) becomes a per-step mask
//! of the tokens that keep the output valid. The vocabulary index ([`GrammarCompiler`]) is built
//! once per model from its `tokenizer.json`; each request gets its own [`Grammar`].

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use vt_core::{Error, Result};

fn grammar_err(what: impl std::fmt::Display) -> Error {
    Error::input(format!("constrained decoding: {what}"))
}

/// What the output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// A JSON schema (`{}`-like `{"type": "object"}` for any object).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

impl ConstraintSpec {
    /// The constraint after free reasoning that ends with `</think>` (for a prompt that leaves a
    /// reasoning block open): the model thinks as it likes, then the output must match.
    pub fn after_reasoning(self) -> ConstraintSpec {
        match self {
            ConstraintSpec::JsonSchema(schema) => ConstraintSpec::Lark(format!(
                "start: think /[ \\t\\r\\n]*/ answer\nthink[suffix=\"</think>\"]: /(?s:.*)/\nanswer: %json {}\n",
                compact(&schema)
            )),
            lark => lark,
        }
    }
}

/// `schema` asking for compact JSON unless it says otherwise: a model that may emit whitespace
/// anywhere can spend its whole budget on it.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false, "lenient": true}));
    }
    schema
}

/// Builds grammars against one model's vocabulary.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl GrammarCompiler {
    /// `tokenizer_json`: the checkpoint's `tokenizer.json`; `stop`: the ids that end a sequence
    /// (the grammar allows them once the output is complete); `vocab`: the model's logits width.
    pub fn new(tokenizer_json: &[u8], stop: &[u32], vocab: usize) -> Result<Self> {
        let mut tok = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(tokenizer_json).map_err(grammar_err)?;
        if !stop.is_empty() {
            tok.set_eos_tokens(stop);
        }
        let env = tok.into_tok_env(Some(vocab)).map_err(grammar_err)?;
        let factory = ParserFactory::new_simple(&env).map_err(grammar_err)?;
        Ok(GrammarCompiler { factory: Arc::new(factory) })
    }

    /// A fresh grammar state for one sequence.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Grammar> {
        let grammar = match spec {
            ConstraintSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            ConstraintSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(grammar_err)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(grammar_err(e));
        }
        Ok(Grammar { matcher })
    }
}

/// One sequence's grammar state.
pub struct Grammar {
    matcher: Matcher,
}

impl Grammar {
    /// The tokens allowed next.
    pub fn mask(&mut self) -> Result<TokenMask> {
        let vob = self.matcher.compute_mask_or_eos().map_err(grammar_err)?;
        if vob.is_zero() {
            return Err(grammar_err("no token can continue the output"));
        }
        Ok(TokenMask(vob))
    }

    /// How many of `drafts` the grammar allows in turn from here; its state does not move. A
    /// verification need not run the drafts after the first one it forbids, which it can never
    /// accept. A stopped grammar (complete, only the stop token left) allows none.
    pub fn allowed_prefix(&mut self, drafts: &[u32]) -> Result<usize> {
        self.matcher.validate_tokens(drafts).map_err(grammar_err)
    }

    /// The masks of a verification's rows: the tokens allowed now, then after each of `drafts`
    /// in turn, as `mask` would give them after `accept`ing the drafts before. They end early
    /// where no later row is picked from: at a draft its row's mask forbids (rejected there), at
    /// one the grammar fails to accept (accepting it fails the sequence), or after a mask's error
    /// (the last entry). The state does not move: a copy walks the drafts.
    pub fn masks_along(&mut self, drafts: &[u32]) -> Vec<Result<TokenMask>> {
        let mut masks = vec![self.mask()];
        if drafts.is_empty() {
            return masks;
        }
        // A shallow copy: it shares the lexer's caches (behind a lock) with this grammar, idle
        // meanwhile.
        let mut walk = Grammar { matcher: self.matcher.clone() };
        for &d in drafts {
            let allowed = matches!(masks.last(), Some(Ok(m)) if m.allows(d));
            if !allowed || walk.accept(d).is_err() {
                break;
            }
            masks.push(walk.mask());
        }
        masks
    }

    /// Advances past the chosen token.
    pub fn accept(&mut self, id: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(()); // the stop token after a complete output
        }
        self.matcher.consume_token(id).map_err(grammar_err)
    }
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Grammar { matcher: self.matcher.deep_clone() }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

/// The tokens a grammar allows at one step.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Sets the logits of disallowed tokens to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, l) in logits.iter_mut().enumerate() {
            if !self.0.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    pub fn allows(&self, id: u32) -> bool {
        self.0.is_allowed(id)
    }

    /// Writes the mask into `words` as `Device::argmax_rows` takes it (token i: bit i % 32 of
    /// word i / 32); tokens past the grammar's vocabulary are disallowed.
    pub fn write_words(&self, words: &mut [u32]) {
        let src = self.0.as_slice();
        let n = src.len().min(words.len());
        words[..n].copy_from_slice(&src[..n]);
        words[n..].fill(0);
    }
}

/// The JSON schema OpenAI's `tool_choice: "required"` implies (vLLM's form): a non-empty array of
/// `{"name": ..., "parameters": ...}` calls to the given tools, at most one when not `parallel`.
pub fn required_tool_calls_schema(tools: &[Value], parallel: bool) -> Value {
    let calls: Vec<Value> = tools
        .iter()
        .map(|t| t.get("function").unwrap_or(t))
        .map(|f| {
            let params = f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}));
            json!({
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    schema
}
