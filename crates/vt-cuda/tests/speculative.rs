//! Speculative decoding with the MTP drafter on CUDA (bf16), through the engine, on the fixtures
//! with an MTP layer: greedy requests of different lengths, decoding together, with the prefix
//! cache on and off, for 1 to 4 drafts a step, get the tokens they get without speculation.
//!
//! The bound. A verification runs a sequence's k + 1 positions as rows of one batch where a
//! decode step runs one, and bf16 GEMMs over other row counts may round differently; so the
//! tokens must agree up to the first position where the two runs' own top-2 logit gap is below
//! tests/parity.rs's bound (8 u of the fixture's largest reference logit: a near tie), after
//! which the runs cannot be compared. A wrong verification, rollback or draft feed gives other
//! tokens where nothing is near a tie.
#![cfg(feature = "cuda")]

use std::path::Path;
use std::sync::{Arc, Mutex};

use vt::{DrafterKind, Engine, EngineConfig, Event, Finish, Model, Request, SamplingParams};
use vt_cuda::CudaBackend;
use vt_test_support::{mtp::mtp_fixtures, Reference};

const U: f32 = 1.0 / 256.0;

/// Pool bytes of each engine (the fixtures are tiny; the default would take most of the device).
const BUDGET: usize = 256 << 20;

/// Each request's tokens, with the top-2 logit gap of the run's own logits where it chose each.
type Run = Vec<Vec<(u32, f32)>>;

fn run(b: &CudaBackend, dir: &Path, config: EngineConfig) -> (Run, (u64, u64)) {
    let model = Model::load(b, dir).unwrap();
    let vocab = model.spec().vocab;
    let mut engine = Engine::new(model, config).unwrap();
    let mut logs = Vec::new();
    for i in 0..6 {
        let prompt = (0..3 + 5 * i).map(|j| ((i * 131 + (j % (4 + i)) * 17 + 1) % vocab) as u32).collect();
        let log: Arc<Mutex<Vec<Event>>> = Arc::default();
        let sink = log.clone();
        let req = Request {
            prompt,
            max_tokens: 16 + 2 * i,
            sampling: SamplingParams::greedy(),
            logprobs: Some(2),
            ..Default::default()
        };
        engine.add(req, Box::new(move |e| sink.lock().map(|mut l| l.push(e)).is_ok())).unwrap();
        logs.push(log);
        // Later requests join a batch that is already decoding.
        if i % 2 == 1 {
            engine.step();
        }
    }
    while engine.has_work() {
        engine.step();
    }
    let runs = logs
        .iter()
        .map(|log| {
            let log = log.lock().unwrap();
            assert_eq!(log.last(), Some(&Event::Done(Finish::Length)), "{log:?}");
            let mut out = Vec::new();
            let mut gap = f32::INFINITY;
            for e in log.iter() {
                match e {
                    Event::Logprobs(lp) => gap = lp.top[0].1 - lp.top[1].1,
                    Event::Token(t) => out.push((*t, gap)),
                    _ => {}
                }
            }
            out
        })
        .collect();
    (runs, engine.speculation_stats())
}

#[test]
fn greedy_with_mtp_speculation_matches_without() {
    let b = CudaBackend::new().unwrap();
    let (mut compared, mut total) = (0, 0);
    for dir in mtp_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let r = Reference::load(&dir);
        let tol = 8.0 * U * r.logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for prefix_cache in [true, false] {
            let plain = EngineConfig { prefix_cache, memory_budget: Some(BUDGET), ..Default::default() };
            let (want, _) = run(&b, &dir, plain.clone());
            for k in 1..=4 {
                let config = EngineConfig { speculative_tokens: k, drafter: DrafterKind::Mtp, ..plain.clone() };
                let (got, (drafted, accepted)) = run(&b, &dir, config);
                let at = format!("{name}: k {k}, prefix cache {prefix_cache}");
                assert!(drafted > 0, "{at}: nothing was drafted");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.len(), w.len(), "{at}: request {i}");
                    let same = g.iter().zip(w).take_while(|(a, b)| a.0 == b.0).count();
                    compared += same;
                    total += w.len();
                    if let (Some(a), Some(z)) = (g.get(same), w.get(same)) {
                        let gap = a.1.min(z.1);
                        assert!(
                            gap < tol,
                            "{at}: request {i} differs at token {same} ({} vs {}), top-2 gap {gap} >= bound {tol}",
                            a.0,
                            z.0
                        );
                    }
                }
                println!("{at}: accepted {accepted} of {drafted} drafts");
            }
        }
    }
    println!("speculative: {compared} of {total} tokens compared equal (the rest after a near tie)");
}
