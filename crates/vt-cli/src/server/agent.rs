//! The request fields agent clients send, checked and turned into vt terms: messages with content
//! parts, tool calls and tool results; `tools` with `tool_choice`; `response_format`; and the
//! allow-list that makes any field vt does not implement a 400 naming it.

use serde_json::{json, Map, Value};
use vt::grammar::{required_tool_calls_schema, ConstraintSpec, GrammarCompiler};
use vt::tool_parser::ToolFormat;
use vt::{Family, Tokenizer};

/// How the server reads chat output and guards chat input.
#[derive(Clone)]
pub struct AgentConfig {
    /// The tool-call format the model writes.
    pub tool_format: ToolFormat,
    /// Split `<think>` reasoning into `reasoning_content`.
    pub reasoning: bool,
    /// Let special tokens typed in messages act as control tokens (off: they are text).
    pub special_tokens_in_messages: bool,
    /// The vocabulary index for constrained decoding (`None` without a tokenizer).
    pub grammar: Option<GrammarCompiler>,
}

impl AgentConfig {
    /// The model's own settings: the tool format its chat template teaches (else its family's),
    /// reasoning on (every served family writes `<think>`), special tokens in messages as text.
    pub fn for_model(tokenizer: Option<&Tokenizer>, family: Family, stop: &[u32], vocab: usize) -> Self {
        let by_family = match family {
            Family::Qwen35Moe => ToolFormat::QwenXml,
            Family::Laguna => ToolFormat::Laguna,
            Family::Qwen3Moe => ToolFormat::Hermes,
        };
        let tool_format = tokenizer.and_then(Tokenizer::chat_template).and_then(ToolFormat::from_template);
        let grammar = tokenizer.and_then(|t| match t.grammar_compiler(stop, vocab) {
            Ok(g) => Some(g),
            Err(e) => {
                eprintln!("constrained decoding is off: {e}");
                None
            }
        });
        AgentConfig {
            tool_format: tool_format.unwrap_or(by_family),
            reasoning: true,
            special_tokens_in_messages: false,
            grammar,
        }
    }
}

/// Fields `/v1/chat/completions` implements.
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "return_tokens_as_token_ids",
    "user",
];

/// Fields `/v1/completions` implements.
pub const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "echo",
    "logit_bias",
    "response_format",
    "return_tokens_as_token_ids",
    "user",
];

/// An error naming the first field of `body` outside `allowed` (`null` values count as absent,
/// as OpenAI's clients send some defaults that way).
pub fn check_fields(body: &Map<String, Value>, allowed: &[&str]) -> Result<(), String> {
    match body.iter().find(|(k, v)| !v.is_null() && !allowed.contains(&k.as_str())) {
        Some((k, _)) => Err(format!("unsupported field `{k}`: vt does not implement it")),
        None => Ok(()),
    }
}

/// The per-request options besides sampling, checked.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub n: usize,
    /// Logprobs of each token and this many alternatives.
    pub logprobs: Option<usize>,
    pub include_usage: bool,
    pub logit_bias: Vec<(u32, f32)>,
    pub stop_token_ids: Vec<u32>,
    /// Logprob tokens as `token_id:N`.
    pub token_ids: bool,
    /// Completions: the prompt's text before the output.
    pub echo: bool,
}

/// Most alternatives per token, and most choices per request.
const MAX_TOP_LOGPROBS: usize = 20;
const MAX_N: usize = 64;

fn get_bool(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(format!("{key} must be a boolean")),
    }
}

fn get_count(body: &Map<String, Value>, key: &str, max: usize) -> Result<Option<usize>, String> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n as usize <= max => Ok(Some(n as usize)),
            _ => Err(format!("{key} must be an integer from 0 to {max}")),
        },
    }
}

/// `n`, logprobs, `stream_options`, `logit_bias`, `stop_token_ids`, `echo` of a request
/// (`chat`: chat's form of logprobs); token ids are checked against `vocab`.
pub fn options(body: &Map<String, Value>, chat: bool, vocab: usize) -> Result<Options, String> {
    let n = get_count(body, "n", MAX_N)?.unwrap_or(1);
    if n == 0 {
        return Err("n must be at least 1".into());
    }
    let logprobs = if chat {
        let top = get_count(body, "top_logprobs", MAX_TOP_LOGPROBS)?;
        match get_bool(body, "logprobs")? {
            Some(true) => Some(top.unwrap_or(0)),
            _ if top.is_some_and(|t| t > 0) => return Err("top_logprobs needs logprobs: true".into()),
            _ => None,
        }
    } else {
        get_count(body, "logprobs", MAX_TOP_LOGPROBS)?
    };
    let echo = get_bool(body, "echo")?.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err("echo with logprobs (the prompt's logprobs) is not supported".into());
    }
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| *k != "include_usage") {
                return Err(format!("unsupported field `stream_options.{k}`: vt does not implement it"));
            }
            if !body.get("stream").and_then(Value::as_bool).unwrap_or(false) {
                return Err("stream_options needs stream: true".into());
            }
            get_bool(o, "include_usage")?.unwrap_or(false)
        }
        Some(_) => return Err("stream_options must be an object".into()),
    };
    let token = |v: &str, what: &str| -> Result<u32, String> {
        v.parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| format!("{what}: `{v}` is not a token id of this model (vocabulary {vocab})"))
    };
    let logit_bias = match body.get("logit_bias") {
        None | Some(Value::Null) => vec![],
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| {
                let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b));
                Ok((
                    token(k, "logit_bias")?,
                    b.ok_or_else(|| format!("logit_bias[{k}] must be from -100 to 100"))? as f32,
                ))
            })
            .collect::<Result<_, String>>()?,
        Some(_) => return Err("logit_bias must be an object of token id to bias".into()),
    };
    let stop_token_ids = match body.get("stop_token_ids") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(ids)) => {
            ids.iter().map(|v| token(&v.to_string(), "stop_token_ids")).collect::<Result<_, _>>()?
        }
        Some(_) => return Err("stop_token_ids must be a list of token ids".into()),
    };
    let token_ids = get_bool(body, "return_tokens_as_token_ids")?.unwrap_or(false);
    Ok(Options { n, logprobs, include_usage, logit_bias, stop_token_ids, token_ids, echo })
}

/// Messages as the chat template wants them: text content parts joined (with "\n", as vLLM joins
/// them for string templates), tool-call arguments as objects, roles checked. Media parts and
/// malformed messages are errors naming what is wrong.
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, String> {
    messages.iter().enumerate().map(|(i, m)| normalize_message(i, m)).collect()
}

fn normalize_message(i: usize, m: &Value) -> Result<Value, String> {
    let mut m = m.as_object().cloned().ok_or_else(|| format!("messages[{i}] must be an object"))?;
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| format!("messages[{i}].role must be a string"))?;
    let role = match role {
        "system" | "user" | "assistant" | "tool" => role.to_string(),
        // OpenAI's newer name for system instructions.
        "developer" => "system".to_string(),
        other => {
            return Err(format!("messages[{i}].role `{other}` is not one of system, developer, user, assistant, tool"))
        }
    };
    m.insert("role".into(), Value::String(role.clone()));
    let content = match m.remove("content").unwrap_or(Value::Null) {
        Value::Null if role == "assistant" => Value::Null,
        Value::Null => return Err(format!("messages[{i}].content is missing")),
        Value::String(s) => Value::String(s),
        Value::Array(parts) => Value::String(join_text_parts(i, &parts)?),
        _ => return Err(format!("messages[{i}].content must be a string or a list of content parts")),
    };
    if content.is_null() && m.get("tool_calls").is_none_or(Value::is_null) {
        return Err(format!("messages[{i}]: an assistant message needs content or tool_calls"));
    }
    m.insert("content".into(), content);
    if let Some(calls) = m.get_mut("tool_calls").filter(|c| !c.is_null()) {
        if role != "assistant" {
            return Err(format!("messages[{i}]: only assistant messages carry tool_calls"));
        }
        let calls = calls.as_array_mut().ok_or_else(|| format!("messages[{i}].tool_calls must be a list"))?;
        for (j, call) in calls.iter_mut().enumerate() {
            let f = call
                .get_mut("function")
                .and_then(Value::as_object_mut)
                .ok_or_else(|| format!("messages[{i}].tool_calls[{j}].function must be an object"))?;
            if !f.get("name").is_some_and(Value::is_string) {
                return Err(format!("messages[{i}].tool_calls[{j}].function.name must be a string"));
            }
            // Templates iterate the arguments as a mapping; OpenAI sends them as JSON text.
            if let Some(Value::String(text)) = f.get("arguments") {
                let args: Value = serde_json::from_str(text)
                    .map_err(|e| format!("messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"))?;
                f.insert("arguments".into(), args);
            }
        }
    }
    Ok(Value::Object(m))
}

fn join_text_parts(i: usize, parts: &[Value]) -> Result<String, String> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match p.get("type").and_then(Value::as_str) {
            Some("text") => texts.push(
                p.get("text").and_then(Value::as_str).ok_or_else(|| format!("messages[{i}].content[{j}].text must be a string"))?,
            ),
            Some(kind) => {
                return Err(format!(
                    "messages[{i}].content[{j}]: content parts of type `{kind}` are not supported; vt serves text-only models"
                ))
            }
            None => return Err(format!("messages[{i}].content[{j}] has no type")),
        }
    }
    Ok(texts.join("\n"))
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The request's tools and what it asks of them.
#[derive(Clone, Debug)]
pub struct Tools {
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls: false`: keep the first call only.
    pub parallel: bool,
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.
pub fn tools(body: &Map<String, Value>) -> Result<Tools, String> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(t)) => t.clone(),
        Some(_) => return Err("tools must be a list".into()),
    };
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(format!("tools[{i}].type must be \"function\""));
        }
        if !t.get("function").and_then(|f| f.get("name")).is_some_and(Value::is_string) {
            return Err(format!("tools[{i}].function.name must be a string"));
        }
    }
    let named = |name: &str| -> Result<ToolChoice, String> {
        if tools.iter().any(|t| t["function"]["name"] == name) {
            Ok(ToolChoice::Named(name.to_string()))
        } else {
            Err(format!("tool_choice names the function `{name}`, which is not in tools"))
        }
    };
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(format!("tool_choice `{other}` is not one of none, auto, required")),
        },
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => named(name)?,
            None => {
                return Err(
                    "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}".into()
                )
            }
        },
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err("tool_choice requires tools".into());
    }
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("parallel_tool_calls must be a boolean".into()),
    };
    Ok(Tools { tools, choice, parallel })
}

/// The grammar a request's `response_format` or `tool_choice` asks for, if any. When the prompt
/// leaves a `<think>` block open (`reasoning_open`), the model reasons freely until `</think>`
/// and the constraint holds from there.
pub fn constraint(
    body: &Map<String, Value>,
    tools: Option<&Tools>,
    reasoning_open: bool,
) -> Result<Option<ConstraintSpec>, String> {
    let spec = plain_constraint(body, tools)?;
    Ok(if reasoning_open { spec.map(ConstraintSpec::after_reasoning) } else { spec })
}

fn plain_constraint(body: &Map<String, Value>, tools: Option<&Tools>) -> Result<Option<ConstraintSpec>, String> {
    let from_tools = tools.and_then(|t| match &t.choice {
        ToolChoice::Required => Some(required_tool_calls_schema(&t.tools, t.parallel)),
        ToolChoice::Named(name) => t
            .tools
            .iter()
            .find(|x| x["function"]["name"] == name.as_str())
            .map(|x| x["function"].get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}))),
        ToolChoice::None | ToolChoice::Auto => None,
    });
    let from_format = match body.get("response_format") {
        None | Some(Value::Null) => None,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "object"})),
            Some("json_schema") => {
                let s = f.get("json_schema").and_then(|s| s.get("schema"));
                Some(s.cloned().ok_or("response_format json_schema needs json_schema.schema")?)
            }
            _ => return Err("response_format.type must be text, json_object or json_schema".into()),
        },
    };
    match (from_tools, from_format) {
        (Some(_), Some(_)) => Err("tool_choice required or named cannot be combined with a response_format".into()),
        (a, b) => Ok(a.or(b).map(ConstraintSpec::JsonSchema)),
    }
}

/// The tool calls a constrained output holds: a `required` call list (`[{"name", "parameters"}]`)
/// or a named function's arguments. `None` when it does not parse (the output is then content).
pub fn constrained_calls(choice: &ToolChoice, output: &str) -> Option<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(output.trim()).ok()?;
    match choice {
        ToolChoice::Named(name) => Some(vec![(name.clone(), serde_json::to_string(&v).ok()?)]),
        ToolChoice::Required => v
            .as_array()?
            .iter()
            .map(|c| Some((c.get("name")?.as_str()?.to_string(), serde_json::to_string(c.get("parameters")?).ok()?)))
            .collect(),
        ToolChoice::None | ToolChoice::Auto => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = check_fields(&obj(json!({"model": "m", "suffix": "x"})), COMPLETION_FIELDS).unwrap_err();
        assert!(e.contains("`suffix`"), "{e}");
        assert!(check_fields(&obj(json!({"model": "m", "suffix": null})), COMPLETION_FIELDS).is_ok());
    }

    #[test]
    fn messages_are_normalized() {
        let m = normalize_messages(&[
            json!({"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}),
            json!({"role": "tool", "tool_call_id": "1", "content": "ok"}),
        ])
        .unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "a\nb"}));
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert!(m[1]["content"].is_null());
        let e = normalize_messages(&[
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        ])
        .unwrap_err();
        assert!(e.contains("image_url") && e.contains("not supported"), "{e}");
        assert!(normalize_messages(&[json!({"role": "assistant", "content": null})]).is_err());
        assert!(normalize_messages(&[json!({"role": "wizard", "content": "x"})]).is_err());
    }

    #[test]
    fn tool_choice_becomes_a_grammar() {
        let body = obj(
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required"}),
        );
        let t = tools(&body).unwrap();
        assert_eq!(t.choice, ToolChoice::Required);
        assert!(constraint(&body, Some(&t), false).unwrap().is_some());
        assert!(matches!(constraint(&body, Some(&t), true).unwrap(), Some(ConstraintSpec::Lark(_))));
        let calls = constrained_calls(&t.choice, "[{\"name\": \"f\", \"parameters\": {\"a\": 1}}]").unwrap();
        assert_eq!(calls, vec![("f".to_string(), "{\"a\":1}".to_string())]);
        let named =
            obj(json!({"tools": body["tools"], "tool_choice": {"type": "function", "function": {"name": "g"}}}));
        assert!(tools(&named).unwrap_err().contains("`g`"));
        let fmt = obj(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}),
        );
        assert_eq!(
            constraint(&fmt, None, false).unwrap(),
            Some(ConstraintSpec::JsonSchema(json!({"type": "integer"})))
        );
    }
}
