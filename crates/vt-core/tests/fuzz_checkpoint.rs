//! Property/fuzz harness (issue 28) over the checkpoint reader: safetensors files with generated
//! headers (dtypes, shapes, offsets, length prefixes, raw bytes) and shard indexes. Whatever the
//! bytes, opening and reading every tensor is an `Ok` or an `Err`, never a panic.
//! `VT_FUZZ_CASES` scales the case counts (CI runs the defaults: 60k here).

use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};
use vt_core::checkpoint::TensorStore;

fn cases(default: u32) -> u32 {
    std::env::var("VT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

/// Opens `dir` and reads every tensor it lists as f32 and i64; only errors may come back.
fn read_all(dir: &Path) {
    let Ok(store) = TensorStore::open_dir(dir) else { return };
    let names: Vec<String> = store.names().map(str::to_string).collect();
    for n in names {
        if let Ok(t) = store.get(&n) {
            let _ = t.to_f32_vec();
            let _ = t.to_i64_vec();
            let _ = t.numel();
        }
    }
    let _ = store.total_bytes();
}

fn dtype() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("F32".to_string()),
        Just("BF16".to_string()),
        Just("F16".to_string()),
        Just("I64".to_string()),
        Just("U8".to_string()),
        Just("F8_E4M3".to_string()),
        Just("I32".to_string()),
        "[A-Z0-9_]{0,8}",
    ]
}

fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..5, Just(u64::MAX), Just(1 << 32), Just((1 << 62) + 1), any::<u64>()]
}

/// A header entry: mostly well-formed, with any field able to go wrong.
fn entry() -> impl Strategy<Value = Value> {
    (dtype(), prop::collection::vec(dim(), 0..4), any::<u64>(), any::<u64>(), 0u8..8).prop_map(
        |(dtype, shape, a, b, how)| match how {
            0 => json!({"dtype": dtype, "shape": shape, "data_offsets": [a % 64, b % 64]}),
            1 => json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
            2 => json!({"dtype": dtype, "shape": shape}),
            3 => json!({"dtype": 5, "shape": "x", "data_offsets": [1]}),
            4 => json!([dtype, shape]),
            _ => json!({"dtype": dtype, "shape": shape, "data_offsets": [0, (a % 16) * 2]}),
        },
    )
}

#[derive(Debug, Clone)]
struct File {
    header: Vec<u8>,
    /// Added to the true header length in the 8-byte prefix (0 mostly).
    prefix_delta: i64,
    data: Vec<u8>,
}

fn file() -> impl Strategy<Value = File> {
    let header = prop_oneof![
        4 => prop::collection::btree_map("[a-z._]{0,6}", entry(), 0..5).prop_map(|m| {
            let mut v: serde_json::Map<String, Value> = m.into_iter().collect();
            v.insert("__metadata__".into(), json!({"format": "pt"}));
            serde_json::to_vec(&v).unwrap()
        }),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ];
    let delta = prop_oneof![8 => Just(0i64), 1 => -16i64..16, 1 => Just(i64::MAX / 2)];
    (header, delta, prop::collection::vec(any::<u8>(), 0..96)).prop_map(|(header, prefix_delta, data)| File {
        header,
        prefix_delta,
        data,
    })
}

fn write_file(path: &Path, f: &File) {
    let len = (f.header.len() as i64).wrapping_add(f.prefix_delta) as u64;
    let mut bytes = len.to_le_bytes().to_vec();
    bytes.extend_from_slice(&f.header);
    bytes.extend_from_slice(&f.data);
    std::fs::write(path, bytes).unwrap();
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("vt-fuzz-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn safetensors_files_never_panic_the_reader() {
    let dir = scratch("safetensors");
    runner(cases(40_000))
        .run(&file(), |f| {
            write_file(&dir.join("model.safetensors"), &f);
            read_all(&dir);
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn shard_indexes_never_panic_the_reader() {
    let dir = scratch("index");
    let shard_name = prop_oneof![
        Just(json!("a.safetensors")),
        Just(json!("b.safetensors")),
        Just(json!("../a.safetensors")),
        Just(json!("/etc/passwd")),
        Just(json!("")),
        Just(json!(7)),
        Just(json!(null)),
        "[a-z./]{0,12}".prop_map(Value::from),
    ];
    let index = prop_oneof![
        4 => prop::collection::btree_map("[a-z.]{0,4}", shard_name, 0..4)
            .prop_map(|m| json!({"metadata": {"total_size": 1}, "weight_map": m}).to_string()),
        1 => Just(json!({"weight_map": []}).to_string()),
        1 => ".{0,40}",
    ];
    runner(cases(20_000))
        .run(&(index, file(), file()), |(index, a, b)| {
            std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
            write_file(&dir.join("a.safetensors"), &a);
            write_file(&dir.join("b.safetensors"), &b);
            read_all(&dir);
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
