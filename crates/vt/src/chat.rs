//! Chat templates rendered as transformers' `apply_chat_template` renders them: the same Jinja
//! settings (`trim_blocks`, `lstrip_blocks`, loop controls), the same `tojson` (Python's
//! `json.dumps`, no HTML escaping), the same context (`messages`, `tools`, `add_generation_prompt`,
//! `bos_token`, `eos_token` and any `chat_template_kwargs`), null message fields dropped,
//! reasoning fields aliased, `{% generation %}` blocks rendered and `continue_final_message` cut
//! the same way.

use std::borrow::Cow;

use minijinja::machinery::{tokenize, Token, WhitespaceConfig};
use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::{Map, Value};
use vt_core::{Error, Result};

/// Everything a chat template sees besides the special tokens.
#[derive(Clone, Copy, Debug)]
pub struct ChatInput<'a> {
    /// OpenAI-style messages (`role`, `content` as text or parts, `tool_calls`, `reasoning_content`...).
    pub messages: &'a [Value],
    /// Tool definitions (`{"type": "function", "function": {...}}`), when the request has any.
    pub tools: Option<&'a [Value]>,
    /// End with the header that starts an assistant turn.
    pub add_generation_prompt: bool,
    /// End inside the final (assistant) message, so the model continues it.
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub kwargs: &'a Map<String, Value>,
}

fn template_err(what: impl std::fmt::Display) -> Error {
    Error::input(format!("chat template: {what}"))
}

/// Names a message's reasoning may come under; templates read the first.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// What `continue_final_message` appends to find where the final message ends (transformers' tag).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A message as transformers' `apply_chat_template` hands it to the template: keys whose value is
/// null dropped (so `content: null` reads as undefined), then `thinking` (first) and
/// `reasoning_content` (last) filled from whichever reasoning field it has, so templates reading
/// either name see it.
fn template_message(message: &Value) -> Value {
    let Some(obj) = message.as_object() else { return message.clone() };
    let obj: Map<String, Value> =
        obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
    let Some(reasoning) = REASONING_FIELDS.iter().find_map(|k| obj.get(*k)).cloned() else {
        return Value::Object(obj);
    };
    let mut out = Map::new();
    out.insert("thinking".into(), reasoning.clone());
    out.extend(obj);
    out.insert("reasoning_content".into(), reasoning);
    Value::Object(out)
}

/// transformers' `{% generation %}...{% endgeneration %}` tag (its extension marking assistant
/// text for training masks) renders its body as a macro call does: in a scope of its own, which is
/// what `{% with %}` gives. minijinja has no such tag, so where minijinja's own lexer finds the tag
/// names at the start of a block, they are renamed; nothing else (strings, comments, raw blocks,
/// whitespace control) is touched.
fn generation_as_with(template: &str) -> Cow<'_, str> {
    if !template.contains("generation") {
        return Cow::Borrowed(template);
    }
    let whitespace = WhitespaceConfig { keep_trailing_newline: false, lstrip_blocks: true, trim_blocks: true };
    let mut renames = Vec::new();
    let mut after_block_start = false;
    for item in tokenize(template, false, Default::default(), whitespace) {
        // A template that does not lex is left as it is: compiling it reports the error.
        let Ok((token, span)) = item else { return Cow::Borrowed(template) };
        if after_block_start {
            let renamed = match token {
                Token::Ident("generation") => Some("with"),
                Token::Ident("endgeneration") => Some("endwith"),
                _ => None,
            };
            if let Some(name) = renamed {
                renames.push((span.start_offset as usize..span.end_offset as usize, name));
            }
        }
        after_block_start = matches!(token, Token::BlockStart);
    }
    if renames.is_empty() {
        return Cow::Borrowed(template);
    }
    let mut out = template.to_string();
    for (range, name) in renames.into_iter().rev() {
        out.replace_range(range, name);
    }
    Cow::Owned(out)
}

/// Python's `json.dumps` with transformers' defaults (`ensure_ascii=False`): `, ` and `: `
/// separators, or `,` and newlines with `indent`.
fn dumps(v: &Value, indent: Option<usize>, sort_keys: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                dumps(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                dumps(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn tojson(value: JinjaValue, kwargs: Kwargs) -> std::result::Result<JinjaValue, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // `ensure_ascii=False` is the default and the only form templates use.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    dumps(&v, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(JinjaValue::from_safe_string(out))
}

/// Renders `template` for `input`, as `apply_chat_template(..., tokenize=False)`.
pub fn render(template: &str, bos: &str, eos: &str, input: &ChatInput) -> Result<String> {
    let mut messages: Vec<Value> = input.messages.iter().map(template_message).collect();
    let mut final_text = None;
    if input.continue_final_message {
        if input.add_generation_prompt {
            return Err(template_err("continue_final_message and add_generation_prompt cannot both be set"));
        }
        final_text = Some(tag_final_message(&mut messages)?);
    }
    let template = generation_as_with(template);
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Templates call Python string and dict methods (`.strip()`, `.startswith()`, `.items()`...).
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    // Python's: None is not iterable (minijinja iterates it as empty).
    env.add_test("iterable", |v: JinjaValue| !v.is_none() && !v.is_undefined() && v.try_iter().is_ok());
    env.add_function("raise_exception", |msg: String| -> std::result::Result<String, JinjaError> {
        Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
    });
    let tmpl = env.template_from_str(&template).map_err(template_err)?;
    let mut ctx: Map<String, Value> = input.kwargs.clone();
    ctx.insert("messages".into(), Value::Array(messages));
    ctx.insert("tools".into(), input.tools.map_or(Value::Null, |t| Value::Array(t.to_vec())));
    ctx.insert("add_generation_prompt".into(), Value::Bool(input.add_generation_prompt));
    ctx.entry("bos_token").or_insert_with(|| Value::String(bos.into()));
    ctx.entry("eos_token").or_insert_with(|| Value::String(eos.into()));
    let rendered = tmpl.render(JinjaValue::from_serialize(&ctx)).map_err(template_err)?;
    match final_text {
        None => Ok(rendered),
        Some(text) => cut_at_tag(rendered, &text),
    }
}

/// Appends the continue tag to the final message's text (its last text part, when in parts);
/// returns that text.
fn tag_final_message(messages: &mut [Value]) -> Result<String> {
    let last = messages.last_mut().ok_or_else(|| template_err("continue_final_message with no messages"))?;
    let content = last.get_mut("content").filter(|c| !c.is_null());
    let content = content.ok_or_else(|| template_err("continue_final_message: the final message has no content"))?;
    let text = match content {
        Value::String(s) => s,
        Value::Array(parts) => parts
            .iter_mut()
            .rev()
            .find_map(|p| p.get_mut("text").and_then(|t| if let Value::String(s) = t { Some(s) } else { None }))
            .ok_or_else(|| template_err("continue_final_message: the final message has no text to continue"))?,
        _ => return Err(template_err("continue_final_message: the final message's content is not text")),
    };
    let original = text.clone();
    text.push_str(CONTINUE_TAG);
    Ok(original)
}

/// Cuts the rendered chat where the final message's text ends (transformers' rule).
fn cut_at_tag(rendered: String, final_text: &str) -> Result<String> {
    let tag = CONTINUE_TAG.trim();
    let missing = || {
        template_err("continue_final_message: the template does not render the final message as given, so it cannot be continued")
    };
    if !rendered.contains(final_text.trim()) {
        return Err(missing());
    }
    let at = rendered.rfind(tag).ok_or_else(missing)?;
    Ok(if rendered[at..].starts_with(CONTINUE_TAG) {
        rendered[..at].to_string()
    } else {
        rendered[..at].trim_end().to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dumped(v: Value, indent: Option<usize>) -> String {
        let mut s = String::new();
        dumps(&v, indent, false, 0, &mut s);
        s
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let v = json!({"b": [1, 2.5, "x<y>&'é"], "a": {}, "c": null, "d": []});
        assert_eq!(dumped(v.clone(), None), r#"{"b": [1, 2.5, "x<y>&'é"], "a": {}, "c": null, "d": []}"#);
        assert_eq!(dumped(json!({"a": [1]}), Some(2)), "{\n  \"a\": [\n    1\n  ]\n}");
    }

    #[test]
    fn messages_are_passed_as_transformers_passes_them() {
        let m = template_message(&json!({"role": "assistant", "content": "x", "reasoning": "r"}));
        let keys: Vec<&String> = m.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["thinking", "role", "content", "reasoning", "reasoning_content"]);
        assert_eq!(m["reasoning_content"], "r");
        let m = template_message(
            &json!({"role": "assistant", "content": null, "reasoning_content": null, "tool_calls": []}),
        );
        assert_eq!(m, json!({"role": "assistant", "tool_calls": []}));
    }

    fn plain(template: &str, kwargs: Map<String, Value>) -> String {
        let input = ChatInput {
            messages: &[],
            tools: None,
            add_generation_prompt: false,
            continue_final_message: false,
            kwargs: &kwargs,
        };
        render(template, "", "", &input).unwrap()
    }

    /// Expected renderings are jinja2's with transformers' environment (`_compile_jinja_template`).
    #[test]
    fn generation_blocks_render_their_body_in_a_scope_of_their_own() {
        let t = "{% set x = 1 %}{%- generation -%} {% set x = 2 %}[{{ x }}]{{ \"{% generation %}\" }}\
                 {# {% generation %} #}{% raw %}{% endgeneration %}{% endraw %}\n  {%- endgeneration %}\n{{ x }}";
        assert_eq!(plain(t, Map::new()), "[2]{% generation %}{% endgeneration %}1");
        let t = "{% for m in ms %}{% set c = m %}{% generation %}{% set c = c ~ \"!\" %}<{{ c }}>{% endgeneration %}{{ c }}\n{% endfor %}";
        let kwargs = Map::from_iter([("ms".to_string(), json!(["a", "b"]))]);
        assert_eq!(plain(t, kwargs), "<a!>a\n<b!>b\n");
        // Not a tag: left alone.
        assert_eq!(plain("{% set generation = 3 %}{{ generation }}", Map::new()), "3");
    }

    #[test]
    fn continue_final_message_ends_inside_it() {
        let t = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}";
        let msgs = [json!({"role": "user", "content": "hi"}), json!({"role": "assistant", "content": "Sure "})];
        let kwargs = Map::new();
        let input = ChatInput {
            messages: &msgs,
            tools: None,
            add_generation_prompt: false,
            continue_final_message: true,
            kwargs: &kwargs,
        };
        assert_eq!(render(t, "", "", &input).unwrap(), "<user>hi</user>\n<assistant>Sure");
    }
}
