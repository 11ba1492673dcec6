//! The engine against single-sequence generation, and its limits, on the committed fixtures.

use std::sync::{Arc, Mutex};

use vt::{
    CpuBackend, Engine, EngineConfig, Event, Finish, GenerateOptions, Model, Request, SamplingParams, SubmitError,
};
use vt_test_support::{all_fixtures, fixture};

type Log = Arc<Mutex<Vec<Event>>>;

fn collect() -> (Log, vt::Sink) {
    let log: Log = Arc::default();
    let l = log.clone();
    (
        log,
        Box::new(move |e| {
            l.lock().unwrap().push(e);
            true
        }),
    )
}

fn tokens(log: &Log) -> Vec<u32> {
    log.lock().unwrap().iter().filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None }).collect()
}

fn finish(log: &Log) -> Option<Finish> {
    log.lock().unwrap().iter().find_map(|e| if let Event::Done(f) = e { Some(*f) } else { None })
}

/// Deterministic prompts of different lengths within the vocabulary.
fn prompts(vocab: usize, n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..3 + 5 * i).map(|j| ((i * 131 + j * 17 + 1) % vocab) as u32).collect()).collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request { prompt, max_tokens, sampling: SamplingParams::greedy(), ..Default::default() }
}

fn run_to_end(engine: &mut Engine<CpuBackend>) {
    while engine.has_work() {
        engine.step();
    }
}

/// Continuous batching (requests join mid-run) and chunked prefill give every sequence the
/// greedy tokens it gets alone, on every model family.
#[test]
fn batched_greedy_equals_alone_on_every_fixture() {
    const N: usize = 6;
    const GEN: usize = 10;
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let model = Model::load(&b, &dir).unwrap();
        let ps = prompts(model.spec().vocab, N);
        let opts = GenerateOptions { max_new_tokens: GEN, ..Default::default() };
        let alone: Vec<Vec<u32>> = ps.iter().map(|p| vt::generate(&model, p, &opts).unwrap().token_ids).collect();
        // 512: whole prompts in one step; 7: prompts split over several steps.
        for max_batch_tokens in [512, 7] {
            let mut engine =
                Engine::new(Model::load(&b, &dir).unwrap(), EngineConfig { max_batch_tokens, ..Default::default() });
            let mut logs = Vec::new();
            for (i, p) in ps.iter().enumerate() {
                let (log, sink) = collect();
                engine.add(request(p.clone(), GEN), sink).unwrap();
                logs.push(log);
                // Later requests join a batch that is already decoding.
                if i % 2 == 1 {
                    engine.step();
                    engine.step();
                }
            }
            run_to_end(&mut engine);
            for (i, log) in logs.iter().enumerate() {
                assert_eq!(tokens(log), alone[i], "{} seq {i} max_batch_tokens {max_batch_tokens}", dir.display());
                assert_eq!(finish(log), Some(Finish::Length));
            }
        }
    }
}

/// Finished sequences' states serve later requests (two run at a time, six requests of different
/// prompts), which get the greedy tokens they get alone: a reused state is emptied of its KV
/// caches and recurrent states. Each fixture family (full and sliding attention, Gated DeltaNet).
#[test]
fn reused_states_compute_as_new_ones_on_every_fixture() {
    const GEN: usize = 6;
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let model = Model::load(&b, &dir).unwrap();
        let ps = prompts(model.spec().vocab, 6);
        let opts = GenerateOptions { max_new_tokens: GEN, ..Default::default() };
        let alone: Vec<Vec<u32>> = ps.iter().map(|p| vt::generate(&model, p, &opts).unwrap().token_ids).collect();
        let mut engine = Engine::new(model, EngineConfig { max_seqs: 2, ..Default::default() });
        let mut logs = Vec::new();
        for (i, p) in ps.iter().enumerate() {
            let (log, sink) = collect();
            engine.add(request(p.clone(), GEN), sink).unwrap();
            logs.push(log);
            if i == 1 {
                run_to_end(&mut engine);
                assert_eq!(engine.kept_states(), 2, "{}: the first two states are kept", dir.display());
            }
        }
        engine.step();
        assert_eq!(engine.kept_states(), 0, "{}: the next two requests take them", dir.display());
        run_to_end(&mut engine);
        assert_eq!(engine.kept_states(), 2);
        for (i, log) in logs.iter().enumerate() {
            assert_eq!(tokens(log), alone[i], "{} seq {i}", dir.display());
        }
    }
}

/// Greedy sequences batched with sampled and penalised ones (whose step reads the logits back)
/// and alone (whose steps take `argmax_rows`) get the same tokens, each from its own row.
#[test]
fn greedy_sampled_and_penalised_sequences_batch_as_alone() {
    const GEN: usize = 8;
    let b = CpuBackend::new();
    let dir = fixture("qwen3moe");
    let ps = prompts(Model::load(&b, &dir).unwrap().spec().vocab, 3);
    let sampling = [
        SamplingParams::greedy(),
        SamplingParams { temperature: 0.8, seed: 7, ..Default::default() },
        SamplingParams { repetition_penalty: 1.3, ..Default::default() },
    ];
    let run = |which: &[usize]| {
        let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), EngineConfig::default());
        let logs: Vec<Log> = which
            .iter()
            .map(|&i| {
                let (log, sink) = collect();
                let req = Request { sampling: sampling[i].clone(), ..request(ps[i].clone(), GEN) };
                engine.add(req, sink).unwrap();
                log
            })
            .collect();
        run_to_end(&mut engine);
        logs.iter().map(tokens).collect::<Vec<_>>()
    };
    let together = run(&[0, 1, 2]);
    for i in 0..3 {
        assert_eq!(together[i], run(&[i])[0], "sequence {i} ({:?})", sampling[i]);
        assert_eq!(together[i].len(), GEN);
    }
}

fn small_engine(config: EngineConfig) -> Engine<CpuBackend> {
    Engine::new(Model::load(&CpuBackend::new(), &fixture("qwen3moe")).unwrap(), config)
}

#[test]
fn stop_tokens_cancellation_and_bad_requests() {
    // Two slots and no waiting room beyond them: a third request is refused.
    let mut engine = small_engine(EngineConfig { max_context: 64, max_seqs: 2, max_queue: 0, ..Default::default() });
    let vocab = engine.model().spec().vocab as u32;
    let alone = vt::generate(engine.model(), &[1, 2, 3], &GenerateOptions { max_new_tokens: 8, ..Default::default() })
        .unwrap()
        .token_ids;

    let (stopped, sink) = collect();
    engine.add(Request { stop_token_ids: vec![alone[2]], ..request(vec![1, 2, 3], 8) }, sink).unwrap();
    let (cancelled, sink) = collect();
    let cancel = engine.add(request(vec![4, 5], 50), sink).unwrap();
    assert!(matches!(engine.add(request(vec![1], 1), collect().1), Err(SubmitError::QueueFull)));
    engine.step();
    engine.step();
    cancel.cancel();
    run_to_end(&mut engine);
    assert_eq!(tokens(&stopped), alone[..3].to_vec());
    assert_eq!(finish(&stopped), Some(Finish::Stop));
    assert_eq!(finish(&cancelled), Some(Finish::Cancelled));
    assert!(tokens(&cancelled).len() < 50);

    // The context caps generation; a prompt at the limit is an error that says so.
    let (capped, sink) = collect();
    engine.add(request(vec![1; 60], 100), sink).unwrap();
    run_to_end(&mut engine);
    assert_eq!((tokens(&capped).len(), finish(&capped)), (4, Some(Finish::Length)));
    let err = engine.add(request(vec![1; 64], 1), collect().1).unwrap_err().to_string();
    assert!(err.contains("context limit is 64"), "{err}");
    for bad in [
        request(vec![], 4),
        request(vec![vocab], 4),
        request(vec![1], 0),
        Request { sampling: SamplingParams { top_p: 0.0, ..Default::default() }, ..request(vec![1], 4) },
    ] {
        assert!(matches!(engine.add(bad, collect().1), Err(SubmitError::Invalid(_))));
    }
}

#[test]
fn memory_budget_limits_running_sequences() {
    // Find what one 8 + 8-token sequence reserves by probing the budget.
    let per_seq = (1..)
        .map(|kb| kb * 1024)
        .find(|&b| {
            small_engine(EngineConfig { memory_budget: Some(b), ..Default::default() })
                .add(request(vec![1; 8], 8), collect().1)
                .is_ok()
        })
        .unwrap();
    let mut engine = small_engine(EngineConfig { memory_budget: Some(2 * per_seq), ..Default::default() });
    let logs: Vec<Log> = (0..5)
        .map(|_| {
            let (log, sink) = collect();
            engine.add(request(vec![1; 8], 8), sink).unwrap();
            log
        })
        .collect();
    let mut most = 0;
    while engine.has_work() {
        engine.step();
        most = most.max(engine.running());
    }
    assert_eq!(most, 2);
    assert!(logs.iter().all(|l| tokens(l).len() == 8));
    // The two finished states are kept within the budget. A shorter request takes the latest,
    // reserved at what that state holds, and the other still fits beside it.
    assert_eq!(engine.kept_states(), 2);
    let (short, sink) = collect();
    engine.add(request(vec![1; 8], 2), sink).unwrap();
    engine.step();
    assert_eq!((engine.running(), engine.kept_states()), (1, 1));
    run_to_end(&mut engine);
    assert_eq!((tokens(&short).len(), engine.kept_states()), (2, 2));
    // A longer request that the budget holds leaves no room beside it: the kept states go.
    let (long, sink) = collect();
    engine.add(request(vec![1; 8], 14), sink).unwrap();
    engine.step();
    assert_eq!((engine.running(), engine.kept_states()), (1, 0));
    run_to_end(&mut engine);
    assert_eq!((tokens(&long).len(), engine.kept_states()), (14, 1));
    let err = engine.add(request(vec![1; 8], 200), collect().1).unwrap_err().to_string();
    assert!(err.contains("memory budget"), "{err}");
}
