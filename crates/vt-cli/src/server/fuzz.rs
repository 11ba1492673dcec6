//! Property/fuzz harness (issue 28) over the request parser: generated bodies for both endpoints
//! (known fields with values of any type and range, unknown fields, raw bytes) go through parsing,
//! the agent options (tools, constraints, logprobs, n), tokenization, the chat template and the
//! checks into engine terms; each ends in `Ok` or an
//! `ApiError`, never a panic. `VT_FUZZ_CASES` scales the case count (CI: 20k).

use std::path::PathBuf;

use axum::body::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};
use vt::{ChatInput, CpuBackend, EngineConfig, EngineHandle, Model, Tokenizer};

use super::agent;
use super::handlers::body;
use super::request::{prepare, OneOrMany, Prompt};
use super::AppState;

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![Just(0i64), Just(-1), Just(1), Just(4095), Just(i64::MAX), any::<i64>()].prop_map(Value::from),
        prop_oneof![Just(u64::MAX), 0u64..300_000].prop_map(Value::from),
        prop_oneof![Just(-0.0f64), Just(2.0), Just(1e39), any::<f64>()].prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::from),
        "(<\\|im_(start|end)\\|>|[a-z ]|\\n){0,10}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 10, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("(role|content|name|[a-z]{1,4})", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every field either endpoint implements, and one neither does.
fn fields() -> Vec<&'static str> {
    let mut all: Vec<&str> = agent::CHAT_FIELDS.iter().chain(agent::COMPLETION_FIELDS).copied().collect();
    all.sort_unstable();
    all.dedup();
    all.push("x");
    all
}

fn bodies() -> impl Strategy<Value = Vec<u8>> {
    let message = (prop_oneof![Just("user"), Just("system"), Just("assistant"), Just("tool"), Just("")], value())
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    let object = (
        prop::collection::btree_map(prop::sample::select(fields()), value(), 0..7),
        prop::option::of(prop::collection::vec(message, 0..4)),
        prop::option::of(prop_oneof![
            prop::collection::vec(0u32..300_000, 0..8).prop_map(|v| json!(v)),
            ".{0,16}".prop_map(Value::from),
        ]),
    )
        .prop_map(|(fields, messages, prompt)| {
            let mut o: serde_json::Map<String, Value> = fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            if let Some(m) = messages {
                o.insert("messages".into(), Value::Array(m));
            }
            if let Some(p) = prompt {
                o.insert("prompt".into(), p);
            }
            serde_json::to_vec(&o).unwrap()
        });
    prop_oneof![8 => object, 1 => prop::collection::vec(any::<u8>(), 0..48), 1 => ".{0,48}".prop_map(String::into_bytes)]
}

/// What the handlers do to a body before submitting it.
fn check(s: &AppState, bytes: &Bytes) {
    let tok = s.tokenizer.as_ref().expect("the built-in model has a tokenizer");
    let vocab = s.engine.spec().vocab;
    if let Ok((map, common)) = body(bytes, agent::COMPLETION_FIELDS) {
        let _ = agent::options(&map, false, vocab);
        let _ = agent::constraint(&map, None, false);
        if let Ok(prompt) = serde_json::from_value::<Prompt>(map.get("prompt").cloned().unwrap_or(Value::Null)) {
            let ids = match prompt {
                Prompt::Ids(ids) => Ok(ids),
                Prompt::Text(OneOrMany::One(t)) => tok.encode(&t, true),
                Prompt::Text(OneOrMany::Many(v)) => tok.encode(&v.concat(), true),
            };
            if let Ok(ids) = ids {
                let _ = prepare(s, common, ids, 16);
            }
        }
    }
    if let Ok((map, common)) = body(bytes, agent::CHAT_FIELDS) {
        let _ = agent::options(&map, true, vocab);
        if let (Some(Value::Array(m)), Ok(tools)) = (map.get("messages"), agent::tools(&map)) {
            let _ = agent::constraint(&map, Some(&tools), false);
            if let Ok(messages) = agent::normalize_messages(m) {
                let kwargs = serde_json::Map::new();
                let input = ChatInput {
                    messages: &messages,
                    tools: (!tools.tools.is_empty()).then_some(tools.tools.as_slice()),
                    add_generation_prompt: true,
                    continue_final_message: false,
                    kwargs: &kwargs,
                };
                let _ = tok.chat_prompt(&input, false);
            }
        }
        let _ = prepare(s, common, vec![1], s.chat_max_tokens);
    }
}

#[test]
fn generated_request_bodies_never_panic_the_parser() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/default");
    let model = Model::load(&CpuBackend::new(), &dir).unwrap();
    let state = AppState::new(
        EngineHandle::spawn(model, EngineConfig::default()).unwrap(),
        Tokenizer::load(&dir).unwrap(),
        "m".into(),
    );
    let cases = std::env::var("VT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
        .run(&bodies(), |b| {
            check(&state, &Bytes::from(b));
            Ok(())
        })
        .unwrap();
}
