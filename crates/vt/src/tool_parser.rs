//! Tool calls out of generated text, streamed or not, for the formats the served families emit:
//!
//! - `QwenXml` (Qwen3.5/3.6, Qwen3-Coder):
//!   `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`
//! - `Hermes` (Qwen3): `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`
//! - `Laguna`: `<tool_call>NAME\n<arg_key>P</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`
//!
//! Text before a call is content; markup never is. A call is emitted whole once its closing tag
//! arrives (or at the end, if it parses without one), so one that turns out malformed is given
//! back as plain content, as written. XML and Laguna values are typed from the tool's JSON schema
//! (strings stay strings; numbers, booleans, objects and arrays are parsed), as vLLM does.

use serde_json::{Map, Value};

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    QwenXml,
    Hermes,
    Laguna,
}

impl ToolFormat {
    /// The format a `--tool-call-parser` value names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "qwen3_xml" | "qwen3_coder" | "qwen_xml" => Some(ToolFormat::QwenXml),
            "hermes" | "qwen3" => Some(ToolFormat::Hermes),
            "laguna" | "poolside_v1" => Some(ToolFormat::Laguna),
            _ => None,
        }
    }

    /// The format a chat template teaches, if it teaches one.
    pub fn from_template(template: &str) -> Option<Self> {
        if template.contains("<arg_key>") {
            Some(ToolFormat::Laguna)
        } else if template.contains("<function=") {
            Some(ToolFormat::QwenXml)
        } else if template.contains(START) {
            Some(ToolFormat::Hermes)
        } else {
            None
        }
    }
}

/// One parsed call; `arguments` is a JSON object's text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolDelta {
    Content(String),
    /// The `index`-th call of the response, complete.
    Call {
        index: usize,
        call: ToolCall,
    },
}

/// Splits streamed text into content and tool calls.
pub struct ToolParser {
    format: ToolFormat,
    /// The request's tools (`{"type": "function", "function": {...}}`), for the parameter types.
    tools: Vec<Value>,
    id_prefix: String,
    /// Text not yet given out: a tail that may begin a call, or the body of an open call.
    buf: String,
    in_call: bool,
    calls: usize,
}

impl ToolParser {
    /// Call ids are `{id_prefix}{index}`.
    pub fn new(format: ToolFormat, tools: &[Value], id_prefix: impl Into<String>) -> Self {
        ToolParser {
            format,
            tools: tools.to_vec(),
            id_prefix: id_prefix.into(),
            buf: String::new(),
            in_call: false,
            calls: 0,
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolDelta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(END) else { break };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + END.len());
                self.in_call = false;
                self.close_call(&body, true, &mut out);
            } else if let Some(start) = self.buf.find(START) {
                let before = self.buf[..start].to_string();
                self.buf.drain(..start + START.len());
                self.content(before, &mut out);
                self.in_call = true;
            } else {
                // Hold back a tail that may be the start of `<tool_call>`.
                let hold = (1..START.len()).rev().find(|&k| self.buf.ends_with(&START[..k])).unwrap_or(0);
                let text: String = self.buf.drain(..self.buf.len() - hold).collect();
                self.content(text, &mut out);
                break;
            }
        }
        out
    }

    /// What is left once generation ends: an unclosed call that parses anyway, or the raw text.
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.in_call) {
            self.close_call(&rest, false, &mut out);
        } else {
            self.content(rest, &mut out);
        }
        out
    }

    /// Content, except whitespace between or after calls (the template's own separators).
    fn content(&self, text: String, out: &mut Vec<ToolDelta>) {
        let separator = self.calls > 0 && text.trim().is_empty();
        if !text.is_empty() && !separator {
            out.push(ToolDelta::Content(text));
        }
    }

    fn close_call(&mut self, body: &str, closed: bool, out: &mut Vec<ToolDelta>) {
        match self.parse_call(body, closed) {
            Some((name, arguments)) => {
                let call = ToolCall { id: format!("{}{}", self.id_prefix, self.calls), name, arguments };
                out.push(ToolDelta::Call { index: self.calls, call });
                self.calls += 1;
            }
            None => {
                let raw = format!("{START}{body}{}", if closed { END } else { "" });
                out.push(ToolDelta::Content(raw));
            }
        }
    }

    /// The name and JSON arguments of a call's body, if it is well formed.
    fn parse_call(&self, body: &str, closed: bool) -> Option<(String, String)> {
        let (name, args) = match self.format {
            ToolFormat::Hermes => parse_hermes(body)?,
            ToolFormat::QwenXml => self.parse_xml(body, closed)?,
            ToolFormat::Laguna => self.parse_laguna(body)?,
        };
        Some((name, serde_json::to_string(&args).ok()?))
    }

    fn schema(&self, function: &str, param: &str) -> Option<&Value> {
        let f = self.tools.iter().map(|t| t.get("function").unwrap_or(t)).find(|f| f["name"] == function)?;
        f.get("parameters")?.get("properties")?.get(param)
    }

    fn parse_xml(&self, body: &str, closed: bool) -> Option<(String, Value)> {
        let inner = body.trim().strip_prefix("<function=")?;
        let (name, mut rest) = inner.split_once('>')?;
        let name = valid_name(name)?;
        let has_end = rest.trim_end().ends_with("</function>");
        if !has_end && !closed {
            return None; // cut off mid-call
        }
        rest = rest.trim_end().strip_suffix("</function>").unwrap_or(rest);
        let mut args = Map::new();
        let mut rest = rest.trim();
        while !rest.is_empty() {
            let after = rest.strip_prefix("<parameter=")?;
            let (param, tail) = after.split_once('>')?;
            // A value ends at its closing tag, or (tolerated, as vLLM does) at the next parameter.
            let (value, next) = match (tail.find("</parameter>"), tail.find("<parameter=")) {
                (Some(e), Some(n)) if n < e => (&tail[..n], &tail[n..]),
                (Some(e), _) => (&tail[..e], &tail[e + "</parameter>".len()..]),
                (None, Some(n)) => (&tail[..n], &tail[n..]),
                (None, None) => (tail, ""),
            };
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            args.insert(param.trim().to_string(), typed(value, self.schema(name, param.trim())));
            rest = next.trim();
        }
        Some((name.to_string(), Value::Object(args)))
    }

    fn parse_laguna(&self, body: &str) -> Option<(String, Value)> {
        let (name, mut rest) = body.split_once("<arg_key>").map_or((body, ""), |(n, r)| (n, r));
        let name = valid_name(name.trim())?;
        let mut args = Map::new();
        while !rest.trim().is_empty() {
            let (key, tail) = rest.split_once("</arg_key>")?;
            let tail = tail.trim_start().strip_prefix("<arg_value>")?;
            let (value, tail) = tail.split_once("</arg_value>")?;
            args.insert(key.trim().to_string(), typed(value, self.schema(name, key.trim())));
            rest = match tail.trim_start() {
                "" => "",
                t => t.strip_prefix("<arg_key>")?,
            };
        }
        Some((name.to_string(), Value::Object(args)))
    }
}

fn parse_hermes(body: &str) -> Option<(String, Value)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = valid_name(v.get("name")?.as_str()?)?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).ok().filter(Value::is_object)?,
        Some(a) if a.is_object() => a.clone(),
        Some(_) => return None,
    };
    Some((name, args))
}

/// A function name: non-empty, one line, no markup.
fn valid_name(name: &str) -> Option<&str> {
    let ok = !name.is_empty() && !name.contains(['<', '>', '\n', ' ', '"']);
    ok.then_some(name)
}

/// A raw parameter value typed by its JSON schema: `string` (or no schema type that says
/// otherwise) stays text, except `null` where the type allows it; other types are parsed,
/// falling back to text when they do not parse.
fn typed(raw: &str, schema: Option<&Value>) -> Value {
    let ty = schema.and_then(|s| s.get("type"));
    let types: Vec<&str> = match ty {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    // A nullable parameter's `null` is the model writing None (templates render it so).
    if types.contains(&"null") && raw.trim() == "null" {
        return Value::Null;
    }
    if types.contains(&"string") {
        return Value::String(raw.to_string());
    }
    if types.is_empty() && schema.is_some() {
        // A schema without a type (enum, anyOf...): JSON when it parses.
        return serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()));
    }
    let trimmed = raw.trim();
    let parsed = match serde_json::from_str::<Value>(trimmed) {
        Ok(v) => Some(v),
        // Python-style booleans, as some models write them.
        Err(_) => match trimmed {
            "True" => Some(Value::Bool(true)),
            "False" => Some(Value::Bool(false)),
            "None" => Some(Value::Null),
            _ => None,
        },
    };
    let fits = |v: &Value| {
        types.is_empty()
            || types.iter().any(|t| match *t {
                "integer" => v.is_i64() || v.is_u64(),
                "number" => v.is_number(),
                "boolean" => v.is_boolean(),
                "object" => v.is_object(),
                "array" => v.is_array(),
                "null" => v.is_null(),
                _ => false,
            })
    };
    match parsed {
        Some(v) if fits(&v) => v,
        _ => Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_follow_the_schema() {
        assert_eq!(typed("42", Some(&json!({"type": "integer"}))), json!(42));
        assert_eq!(typed("42", Some(&json!({"type": "string"}))), json!("42"));
        assert_eq!(typed("4.5", Some(&json!({"type": "integer"}))), json!("4.5"));
        assert_eq!(typed("True", Some(&json!({"type": "boolean"}))), json!(true));
        assert_eq!(typed("[1, 2]", None), json!([1, 2]));
        assert_eq!(typed("hi there", None), json!("hi there"));
        assert_eq!(typed("{\"a\": 1}", Some(&json!({"type": ["object", "null"]}))), json!({"a": 1}));
        assert_eq!(typed("null", Some(&json!({"type": ["string", "null"]}))), json!(null));
        assert_eq!(typed("null", Some(&json!({"type": "string"}))), json!("null"));
    }
}
