//! Tool-call and reasoning parsers: every format, whole and streamed in random chunkings (the
//! result must not depend on where the text was cut), and malformed output, which must come back
//! as plain content exactly as generated.

use serde_json::{json, Value};
use vt::chat::ChatInput;
use vt::reasoning::{ReasoningParser, Split};
use vt::tool_parser::{ToolDelta, ToolFormat, ToolParser};

/// A small seeded generator for the chunkings.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// `text` cut into pieces at random character boundaries (sometimes one character each).
fn chunkings(text: &str, n: usize) -> Vec<Vec<String>> {
    let chars: Vec<char> = text.chars().collect();
    let mut rng = Lcg(0x5eed ^ text.len() as u64);
    let mut all = vec![vec![text.to_string()], chars.iter().map(|c| c.to_string()).collect()];
    for _ in 0..n {
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let len = 1 + rng.below(12);
            pieces.push(chars[i..(i + len).min(chars.len())].iter().collect());
            i += len;
        }
        all.push(pieces);
    }
    all
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "wind": {"type": "boolean"},
        "zip": {"type": "string"}, "opts": {"type": "object"}}}}}),
    ]
}

/// Content and (name, arguments as JSON) of the calls, from streaming `pieces`.
fn run_tools(format: ToolFormat, pieces: &[String]) -> (String, Vec<(String, Value)>) {
    let mut p = ToolParser::new(format, &tools(), "call_");
    let mut deltas: Vec<ToolDelta> = pieces.iter().flat_map(|c| p.push(c)).collect();
    deltas.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for d in deltas {
        match d {
            ToolDelta::Content(t) => content.push_str(&t),
            ToolDelta::Call { index, call } => {
                assert_eq!(index, calls.len());
                assert_eq!(call.id, format!("call_{index}"));
                calls.push((call.name, serde_json::from_str(&call.arguments).unwrap()));
            }
        }
    }
    (content, calls)
}

fn check_tools(format: ToolFormat, text: &str, content: &str, calls: &[(&str, Value)]) {
    let want: Vec<(String, Value)> = calls.iter().map(|(n, a)| (n.to_string(), a.clone())).collect();
    for pieces in chunkings(text, 200) {
        let (got_content, got_calls) = run_tools(format, &pieces);
        assert_eq!(got_content, content, "{format:?} content, chunks {pieces:?}");
        assert_eq!(got_calls, want, "{format:?} calls, chunks {pieces:?}");
    }
}

/// Malformed output is all content, exactly as generated.
fn check_plain(format: ToolFormat, text: &str) {
    check_tools(format, text, text, &[]);
}

#[test]
fn qwen_xml_calls() {
    let f = ToolFormat::QwenXml;
    let one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    check_tools(f, one, "", &[("get_weather", json!({"city": "San Francisco", "days": 3}))]);
    let two = format!(
        "Let me check.\n\n{one}\n<tool_call>\n<function=get_weather>\n<parameter=zip>\n02139\n</parameter>\n<parameter=wind>\ntrue\n</parameter>\n<parameter=opts>\n{{\"a\": [1, 2]}}\n</parameter>\n<parameter=note>\nline 1\nline 2 <b>\n</parameter>\n</function>\n</tool_call>"
    );
    check_tools(
        f,
        &two,
        "Let me check.\n\n",
        &[
            ("get_weather", json!({"city": "San Francisco", "days": 3})),
            ("get_weather", json!({"zip": "02139", "wind": true, "opts": {"a": [1, 2]}, "note": "line 1\nline 2 <b>"})),
        ],
    );
    // Cut off after </function>: still a whole call.
    check_tools(f, "<tool_call>\n<function=f>\n</function>", "", &[("f", json!({}))]);
    // A number that is not an integer stays text; a tag-like text that is not a call is content.
    check_tools(f, "a <tool_ b", "a <tool_ b", &[]);
}

#[test]
fn qwen_xml_malformed_is_content() {
    let f = ToolFormat::QwenXml;
    check_plain(f, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n");
    check_plain(f, "<tool_call>\nget_weather(city=Paris)\n</tool_call>");
    check_plain(f, "before <tool_call><function=bad name>\n</function></tool_call> after");
    check_plain(f, "<tool_call>");
}

#[test]
fn hermes_calls() {
    let f = ToolFormat::Hermes;
    let text = "Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>";
    check_tools(
        f,
        text,
        "Sure.",
        &[("get_weather", json!({"city": "Paris", "days": 2})), ("get_weather", json!({"city": "Rome"}))],
    );
    check_tools(f, "<tool_call>{\"name\": \"ping\"}</tool_call>", "", &[("ping", json!({}))]);
}

#[test]
fn hermes_malformed_is_content() {
    let f = ToolFormat::Hermes;
    check_plain(f, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>");
    check_plain(f, "<tool_call>\n{\"arguments\": {}}\n</tool_call>");
    check_plain(f, "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>");
    check_plain(f, "x <tool_call>{\"name\": \"f\", \"argum");
    // Cut off before its closing tag but whole: a call.
    check_tools(f, "x <tool_call>{\"name\": \"f\"}", "x ", &[("f", json!({}))]);
}

#[test]
fn laguna_calls() {
    let f = ToolFormat::Laguna;
    let text = "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>007</arg_value>\n<arg_key>items</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>\n";
    check_tools(
        f,
        text,
        "Sure.\n",
        &[("get_weather", json!({"city": "Paris", "days": 2, "zip": "007", "items": [1, 2]}))],
    );
    let compact =
        "<tool_call>list_dir<arg_key>path</arg_key><arg_value>/tmp</arg_value></tool_call><tool_call>noop</tool_call>";
    check_tools(f, compact, "", &[("list_dir", json!({"path": "/tmp"})), ("noop", json!({}))]);
    // Text before and inside a call that is not ASCII (byte and character offsets differ), v8's
    // compact form with schema-typed values.
    let compact = "Voilà:<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>wind</arg_key><arg_value>true</arg_value><arg_key>opts</arg_key><arg_value>{\"unit\": \"°C\"}</arg_value></tool_call>";
    let args = json!({"city": "Zürich", "days": 3, "wind": true, "opts": {"unit": "°C"}});
    check_tools(f, compact, "Voilà:", &[("get_weather", args)]);
}

#[test]
fn laguna_malformed_is_content() {
    let f = ToolFormat::Laguna;
    check_plain(f, "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>");
    check_plain(f, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</tool_call>");
    check_plain(f, "<tool_call></tool_call>");
    check_plain(f, "<tool_call>get weather</tool_call>");
}

/// What Laguna's published templates (tests/templates/laguna_v2.jinja, newline-separated tags, and
/// laguna_v8.jinja, compact) show the model writing after the generation prompt comes back, streamed
/// in random chunkings through the reasoning and Laguna tool parsers as the server chains them, as
/// the reasoning, content and calls it was rendered from, the arguments typed by the tool's schema.
#[test]
fn laguna_templates_round_trip() {
    let tool = json!({"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "ratio": {"type": "number"},
        "force": {"type": "boolean"}, "cwd": {"type": ["string", "null"]}, "files": {"type": "array"},
        "env": {"type": "object"}, "zip": {"type": "string"}, "note": {"type": "string"}}}}});
    let args = json!({"cmd": "ls -la ~/\"dir\" | head", "timeout": 30, "ratio": 0.25, "force": false, "cwd": null,
        "files": ["a.txt", "é/b"], "env": {"K": "v", "N": 1}, "zip": "007", "note": "two\nlines <b>"});
    let calls = json!([
        {"id": "c0", "type": "function", "function": {"name": "run", "arguments": args}},
        {"id": "c1", "type": "function", "function": {"name": "run", "arguments": {"cmd": "pwd"}}},
    ]);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
    for file in ["laguna_v2.jinja", "laguna_v8.jinja"] {
        let template = std::fs::read_to_string(dir.join(file)).unwrap();
        assert_eq!(ToolFormat::from_template(&template), Some(ToolFormat::Laguna), "{file}");
        for thinking in [false, true] {
            let what = format!("{file} thinking {thinking}");
            let reasoning = if thinking { "Plan: list, then pwd." } else { "" };
            let user = json!({"role": "user", "content": "List files."});
            let mut answer = json!({"role": "assistant", "content": "Running it.", "tool_calls": calls});
            if thinking {
                answer["reasoning_content"] = json!(reasoning);
            }
            let kwargs = serde_json::Map::from_iter([("enable_thinking".to_string(), json!(thinking))]);
            let tools = [tool.clone()];
            let render = |messages: &[Value], add_generation_prompt: bool| {
                let input = ChatInput {
                    messages,
                    tools: Some(&tools),
                    add_generation_prompt,
                    continue_final_message: false,
                    kwargs: &kwargs,
                };
                vt::chat::render(&template, "", "", &input).unwrap()
            };
            let prompt = render(std::slice::from_ref(&user), true);
            let full = render(&[user, answer], false);
            let written = full.strip_prefix(prompt.as_str()).and_then(|w| w.strip_suffix("</assistant>\n"));
            let written = written.unwrap_or_else(|| panic!("{what}: the turn does not continue the prompt: {full:?}"));
            assert_eq!(vt::reasoning::prompt_opens_reasoning(&prompt), thinking, "{what}");
            for pieces in chunkings(written, 50) {
                let mut r = ReasoningParser::new(thinking);
                let mut p = ToolParser::new(ToolFormat::Laguna, &tools, "call_");
                let (mut got_reasoning, mut content_pieces) = (String::new(), Vec::new());
                let mut splits: Vec<Split> = pieces.iter().map(|c| r.push(c)).collect();
                splits.push(r.finish());
                for split in splits {
                    got_reasoning.push_str(&split.reasoning);
                    content_pieces.push(split.content);
                }
                assert_eq!(got_reasoning.trim(), reasoning, "{what}: {pieces:?}");
                let mut deltas: Vec<ToolDelta> = content_pieces.iter().flat_map(|c| p.push(c)).collect();
                deltas.extend(p.finish());
                let (mut content, mut got) = (String::new(), Vec::new());
                for d in deltas {
                    match d {
                        ToolDelta::Content(t) => content.push_str(&t),
                        ToolDelta::Call { call, .. } => got.push(json!({"name": call.name,
                            "arguments": serde_json::from_str::<Value>(&call.arguments).unwrap()})),
                    }
                }
                assert_eq!(content.trim(), "Running it.", "{what}: {pieces:?}");
                let want: Vec<Value> = calls.as_array().unwrap().iter().map(|c| c["function"].clone()).collect();
                assert_eq!(got, want, "{what}: {pieces:?}");
            }
        }
    }
}

fn run_reasoning(open: bool, pieces: &[String]) -> Split {
    let mut p = ReasoningParser::new(open);
    let mut all = Split::default();
    let mut splits: Vec<Split> = pieces.iter().map(|c| p.push(c)).collect();
    splits.push(p.finish());
    for s in splits {
        all.reasoning.push_str(&s.reasoning);
        all.content.push_str(&s.content);
    }
    all
}

fn check_reasoning(open: bool, text: &str, reasoning: &str, content: &str) {
    for pieces in chunkings(text, 200) {
        let got = run_reasoning(open, &pieces);
        assert_eq!((got.reasoning.as_str(), got.content.as_str()), (reasoning, content), "{pieces:?}");
    }
}

#[test]
fn reasoning_splits_from_content() {
    // The template opened the block (thinking on).
    check_reasoning(
        true,
        "\nLet me see </thin k>.\n</think>\n\nAnswer <b>",
        "\nLet me see </thin k>.\n",
        "\n\nAnswer <b>",
    );
    check_reasoning(true, "never closed </thi", "never closed </thi", "");
    // The model opens it.
    check_reasoning(false, "  <think>hm</think>ok", "hm", "ok");
    check_reasoning(false, "<thinking is fun", "", "<thinking is fun");
    // No block: all content, including a later tag.
    check_reasoning(false, "plain <think>x</think>", "", "plain <think>x</think>");
    check_reasoning(false, "<thi", "", "<thi");
    assert!(vt::reasoning::prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
    assert!(!vt::reasoning::prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(!vt::reasoning::prompt_opens_reasoning("<|im_start|>assistant\n"));
}
