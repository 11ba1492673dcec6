//! Constrained decoding and logprobs through the engine, on the built-in model: a JSON schema
//! holds even for a tiny model sampling hot, and each token's logprobs are the log-softmax of the
//! model's own logits at that position.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use vt::grammar::{ConstraintSpec, GrammarCompiler};
use vt::{CpuBackend, Engine, EngineConfig, Event, Logits, Model, Request, SamplingParams, Tokenizer};
use vt_core::Device;
use vt_test_support::repo_root;

fn run(engine: &mut Engine<CpuBackend>, req: Request) -> Vec<Event> {
    let log: Arc<Mutex<Vec<Event>>> = Arc::default();
    let l = log.clone();
    engine
        .add(
            req,
            Box::new(move |e| {
                l.lock().unwrap().push(e);
                true
            }),
        )
        .unwrap();
    while engine.has_work() {
        engine.step();
    }
    let events = log.lock().unwrap().clone();
    events
}

fn ids(events: &[Event]) -> Vec<u32> {
    events.iter().filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None }).collect()
}

#[test]
fn json_schema_output_is_valid_however_it_samples() {
    let dir = repo_root().join("models/default");
    let b = CpuBackend::new();
    let model = Model::load(&b, &dir).unwrap();
    let tok = Tokenizer::load(&dir).unwrap().unwrap();
    let eos = tok.eos_id().unwrap();
    let vocab = model.spec().vocab;
    let compiler = GrammarCompiler::new(&std::fs::read(dir.join("tokenizer.json")).unwrap(), &[eos], vocab).unwrap();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 1000}, "ok": {"type": "boolean"}},
        "required": ["name", "n", "ok"], "additionalProperties": false});
    let spec = ConstraintSpec::JsonSchema(schema);
    let mut engine = Engine::new(model, EngineConfig::default()).unwrap();
    let prompt = tok.encode("Give me JSON:", false).unwrap();
    for seed in 0..4 {
        let req = Request {
            prompt: prompt.clone(),
            max_tokens: 200,
            sampling: SamplingParams { temperature: 1.5, seed, ..Default::default() },
            stop_token_ids: vec![eos],
            grammar: Some(compiler.compile(&spec).unwrap()),
            ..Default::default()
        };
        let events = run(&mut engine, req);
        let out = ids(&events);
        assert_eq!(out.last(), Some(&eos), "seed {seed}: the grammar ends the output with the stop token");
        let text = tok.decode(&out).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 8), "{text}");
        assert!(
            v["n"].as_i64().is_some_and(|n| (0..=1000).contains(&n))
                && v["ok"].is_boolean()
                && v.as_object().unwrap().len() == 3,
            "{text}"
        );
    }
}

/// Greedy rows under a grammar are picked by the backend's `argmax_rows` with the masks as
/// bitsets (batched here with an unconstrained row between two constrained ones, so each mask
/// must land on its own row); the sampling path (a zero `logit_bias` makes a request take it:
/// `sample_rows` at temperature 0, the mask as the pick's `allowed`) picks the same tokens.
#[test]
fn greedy_masks_on_the_backend_pick_as_the_host_path() {
    let dir = repo_root().join("models/default");
    let b = CpuBackend::new();
    let model = Model::load(&b, &dir).unwrap();
    let tok = Tokenizer::load(&dir).unwrap().unwrap();
    let eos = tok.eos_id().unwrap();
    let compiler =
        GrammarCompiler::new(&std::fs::read(dir.join("tokenizer.json")).unwrap(), &[eos], model.spec().vocab).unwrap();
    let spec = ConstraintSpec::JsonSchema(json!({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 6}, "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["a", "b"], "additionalProperties": false}));
    let mut engine = Engine::new(model, EngineConfig::default()).unwrap();
    let request = |text: &str, constrained: bool, host: bool| Request {
        prompt: tok.encode(text, false).unwrap(),
        max_tokens: 40,
        sampling: SamplingParams { logit_bias: if host { vec![(0, 0.0)] } else { vec![] }, ..Default::default() },
        stop_token_ids: vec![eos],
        grammar: constrained.then(|| compiler.compile(&spec).unwrap()),
        ..Default::default()
    };
    let cases = [("JSON please:", true), ("def main():", false), ("An object", true)];
    let logs: Vec<Arc<Mutex<Vec<Event>>>> = cases.iter().map(|_| Arc::default()).collect();
    for (&(text, constrained), log) in cases.iter().zip(&logs) {
        let l = log.clone();
        let sink = Box::new(move |e| {
            l.lock().unwrap().push(e);
            true
        });
        engine.add(request(text, constrained, false), sink).unwrap();
    }
    while engine.has_work() {
        engine.step();
    }
    for (&(text, constrained), log) in cases.iter().zip(&logs) {
        let batched = ids(&log.lock().unwrap());
        let host = ids(&run(&mut engine, request(text, constrained, true)));
        assert_eq!(batched, host, "{text:?}: {:?}", tok.decode(&batched));
        assert!(batched.len() > 5, "{text:?}");
        if constrained && batched.last() == Some(&eos) {
            let json = tok.decode(&batched[..batched.len() - 1]).unwrap();
            assert!(serde_json::from_str::<Value>(&json).is_ok(), "{json:?}");
        }
    }
}

#[test]
fn logprobs_are_the_log_softmax_of_the_model_logits() {
    let dir = repo_root().join("models/default");
    let b = CpuBackend::new();
    let model = Model::load(&b, &dir).unwrap();
    let prompt = vec![5, 17, 300, 42];
    // The reference: every position's logits of the prompt plus the generated tokens at once.
    let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), EngineConfig::default()).unwrap();
    for sampling in [SamplingParams::greedy(), SamplingParams { temperature: 1.0, seed: 9, ..Default::default() }] {
        let req = Request { prompt: prompt.clone(), max_tokens: 6, sampling, logprobs: Some(4), ..Default::default() };
        let events = run(&mut engine, req);
        let out = ids(&events);
        let lps: Vec<vt::TokenLogprobs> =
            events.iter().filter_map(|e| if let Event::Logprobs(l) = e { Some(l.clone()) } else { None }).collect();
        assert_eq!(lps.len(), out.len());
        // Each Logprobs comes right before its Token.
        for (i, e) in events.iter().enumerate() {
            if matches!(e, Event::Logprobs(_)) {
                assert!(matches!(events[i + 1], Event::Token(_)));
            }
        }
        let all: Vec<u32> = prompt.iter().chain(&out[..out.len() - 1]).copied().collect();
        let mut state = model.new_state(4096).unwrap();
        let logits = b.to_f32(&model.forward(&all, &mut state, Logits::All).unwrap()).unwrap();
        let vocab = model.spec().vocab;
        for (i, lp) in lps.iter().enumerate() {
            let row = &logits[(prompt.len() - 1 + i) * vocab..(prompt.len() + i) * vocab];
            let want = vt::sampling::token_logprobs(row, out[i], 4);
            assert!((want.logprob - lp.logprob).abs() < 1e-4, "token {i}: {} vs {}", want.logprob, lp.logprob);
            assert_eq!(
                want.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                lp.top.iter().map(|t| t.0).collect::<Vec<_>>()
            );
            for (w, g) in want.top.iter().zip(&lp.top) {
                assert!((w.1 - g.1).abs() < 1e-4);
            }
        }
    }
}

/// After a prompt that opens `<think>`, the grammar lets the model reason freely and holds the
/// schema from `</think>` on.
#[test]
fn constraint_after_reasoning_allows_free_thought_then_the_schema() {
    let dir = repo_root().join("models/default");
    let tok = Tokenizer::load(&dir).unwrap().unwrap();
    let eos = tok.eos_id().unwrap();
    let compiler = tok.grammar_compiler(&[eos], 3072).unwrap();
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]});
    let spec = ConstraintSpec::JsonSchema(schema).after_reasoning();
    let walk = |text: &str| -> Option<vt::grammar::Grammar> {
        let mut g = compiler.compile(&spec).unwrap();
        for id in tok.encode(text, false).unwrap() {
            if !g.mask().unwrap().allows(id) {
                return None;
            }
            g.accept(id).unwrap();
        }
        Some(g)
    };
    let mut done = walk("any thought {\"ok\": 1} here</think>\n\n{\"ok\":true}").expect("reasoning then the schema");
    assert!(done.mask().unwrap().allows(eos), "complete: the stop token is allowed");
    assert!(walk("thought</think>\n\nnot json").is_none(), "after </think> only the schema");
}

/// A verification's masks (`Grammar::masks_along`) are the masks stepping through its drafts
/// gives, up to the first draft the grammar forbids (which `allowed_prefix` counts up to), and
/// leave the grammar where it was.
#[test]
fn masks_along_drafts_are_the_stepwise_masks() {
    let dir = repo_root().join("models/default");
    let tok = Tokenizer::load(&dir).unwrap().unwrap();
    let eos = tok.eos_id().unwrap();
    let vocab = Model::load(&CpuBackend::new(), &dir).unwrap().spec().vocab;
    let compiler = tok.grammar_compiler(&[eos], vocab).unwrap();
    let spec = ConstraintSpec::JsonSchema(json!({"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"], "additionalProperties": false}));
    let words = |m: &vt::grammar::TokenMask| {
        let mut w = vec![0; vt_core::backend::mask_words(vocab)];
        m.write_words(&mut w);
        w
    };
    let text = tok.encode("{\"a\":\"xy z\",\"b\":[12,3]}", false).unwrap();
    let mut g = compiler.compile(&spec).unwrap();
    // From every position: the next three tokens of the text, then one the grammar forbids there.
    for at in 0..text.len() {
        let mut drafts: Vec<u32> = text[at..].iter().take(3).copied().collect();
        let allowed = drafts.len();
        let mut step = g.clone();
        let mut want = Vec::new();
        for &d in &drafts {
            want.push(words(&step.mask().unwrap()));
            step.accept(d).unwrap();
        }
        let last = step.mask().unwrap();
        drafts.push((0..vocab as u32).find(|&t| !last.allows(t)).unwrap());
        want.push(words(&last));
        let before = words(&g.mask().unwrap());
        assert_eq!(g.allowed_prefix(&drafts).unwrap(), allowed, "{at}");
        let got: Vec<Vec<u32>> = g.masks_along(&drafts).iter().map(|m| words(m.as_ref().unwrap())).collect();
        assert!(got == want, "{at}: the masks differ from stepping through the drafts");
        assert!(words(&g.mask().unwrap()) == before, "{at}: the grammar moved");
        g.accept(text[at]).unwrap();
    }
}
