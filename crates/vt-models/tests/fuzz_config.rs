//! Property/fuzz harness (issue 28) over config.json: every fixture's config (and the built-in
//! model's) with fields replaced, removed or added at random, nested ones included, and raw text.
//! Parsing and building the model spec is an `Ok` or an `Err` naming the field, never a panic.
//! `VT_FUZZ_CASES` scales the case count (CI runs the default: 30k).

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use serde_json::{json, Value};
use vt_core::checkpoint::Config;
use vt_models::ModelSpec;

fn configs() -> Vec<Value> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("fixtures")).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.push(root.join("models/default"));
    dirs.sort();
    dirs.iter()
        .map(|d| serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap())
        .collect()
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![Just(0i64), Just(-1), Just(1), Just(2), Just(3), Just(i64::MAX), Just(i64::MIN), any::<i64>()]
            .prop_map(Value::from),
        prop_oneof![Just(u64::MAX), Just(1u64 << 40), 0u64..100_000].prop_map(Value::from),
        prop_oneof![Just(0.0f64), Just(-0.5), Just(1e300), Just(1e-300), Just(0.5), any::<f64>()]
            .prop_map(|f| json!(f)),
        "[a-z_0-9]{0,10}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One edit: at the `pick`-th key (of the root, or of a nested object), set, remove or add.
#[derive(Debug, Clone)]
struct Edit {
    pick: usize,
    nested: usize,
    how: u8,
    value: Value,
}

fn apply(cfg: &mut Value, e: &Edit) {
    let mut target = &mut *cfg;
    // Step into a nested object (rope_parameters, text_config, quantization_config...) sometimes.
    if e.nested.is_multiple_of(3) {
        let keys: Vec<String> = target
            .as_object()
            .map(|o| o.iter().filter(|(_, v)| v.is_object()).map(|(k, _)| k.clone()).collect())
            .unwrap_or_default();
        if !keys.is_empty() {
            target = &mut target[&keys[e.nested / 3 % keys.len()]];
        }
    }
    let Some(obj) = target.as_object_mut() else { return };
    let keys: Vec<String> = obj.keys().cloned().collect();
    if keys.is_empty() {
        return;
    }
    let key = &keys[e.pick % keys.len()];
    match e.how % 4 {
        0 | 1 => {
            obj.insert(key.clone(), e.value.clone());
        }
        2 => {
            obj.remove(key);
        }
        _ => {
            // A list field of the wrong length, or a number field made a list.
            let v = obj.get(key).cloned().unwrap_or(Value::Null);
            let list = match v {
                Value::Array(mut a) => {
                    a.truncate(e.pick % (a.len() + 1));
                    Value::Array(a)
                }
                other => json!([other]),
            };
            obj.insert(key.clone(), list);
        }
    }
}

fn edit() -> impl Strategy<Value = Edit> {
    (any::<usize>(), any::<usize>(), any::<u8>(), value()).prop_map(|(pick, nested, how, value)| Edit {
        pick,
        nested,
        how,
        value,
    })
}

fn build(path: &Path, text: &str) {
    if let Ok(cfg) = Config::from_str(path, text) {
        let _ = ModelSpec::from_config(&cfg);
    }
}

#[test]
fn edited_configs_never_panic_the_spec_builder() {
    let bases = configs();
    let path = Path::new("config.json");
    let cases = std::env::var("VT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(30_000);
    let input = prop_oneof![
        9 => (0..bases.len(), prop::collection::vec(edit(), 1..4)).prop_map(move |(i, edits)| {
            let mut cfg = bases[i].clone();
            for e in &edits {
                apply(&mut cfg, e);
            }
            cfg.to_string()
        }),
        1 => ".{0,64}",
    ];
    TestRunner::new(RunnerConfig { cases, failure_persistence: None, ..RunnerConfig::default() })
        .run(&input, |text| {
            build(path, &text);
            Ok(())
        })
        .unwrap();
}
