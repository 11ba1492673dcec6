//! The engine against single-sequence generation, and its limits, on the committed fixtures.

mod support;

use support::{collect, Log};
use vt::{
    CpuBackend, Engine, EngineConfig, Event, Finish, GenerateOptions, Model, Request, SamplingParams, SubmitError,
};
use vt_test_support::{all_fixtures, fixture};

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
                Engine::new(Model::load(&b, &dir).unwrap(), EngineConfig { max_batch_tokens, ..Default::default() })
                    .unwrap();
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
        let mut engine = Engine::new(model, EngineConfig { max_seqs: 2, ..Default::default() }).unwrap();
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

/// Greedy sequences batched with sampled and penalised ones (whose steps take `sample_rows`)
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
        let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), EngineConfig::default()).unwrap();
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

/// Sampled steps pick where the logits are: an engine running sampled, filtered, penalised and
/// biased requests, with logprobs and a request of two choices, reads no logits back
/// (`CpuBackend::bytes_read_back` counts what `to_f32` copies out, as a device backend would
/// copy it; the picking ops read the logits in place), and each choice gets the tokens the host
/// sampler (`vt::generate`, which reads every row back) draws with its seed.
#[test]
fn sampled_steps_read_no_logits_back_and_draw_as_the_host_sampler() {
    const GEN: usize = 8;
    let b = CpuBackend::new();
    let dir = fixture("qwen3moe");
    let model = Model::load(&b, &dir).unwrap();
    let ps = prompts(model.spec().vocab, 3);
    let sampling = [
        SamplingParams { temperature: 0.9, top_p: 0.8, seed: 3, ..Default::default() },
        SamplingParams {
            temperature: 1.3,
            top_k: 20,
            min_p: 0.02,
            repetition_penalty: 1.2,
            presence_penalty: 0.4,
            frequency_penalty: 0.3,
            logit_bias: vec![(5, 2.0), (9, -1.0)],
            seed: 5,
            ..Default::default()
        },
        SamplingParams { frequency_penalty: 0.5, ..Default::default() },
    ];
    let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), EngineConfig::default()).unwrap();
    // Request 0 has two choices, seeds 3 and 4.
    let mut logs: Vec<(usize, u64, Log)> = Vec::new();
    for (i, p) in sampling.iter().enumerate() {
        let choices = if i == 0 { 2 } else { 1 };
        let (choice_logs, sinks): (Vec<Log>, Vec<vt::Sink>) = (0..choices).map(|_| collect()).unzip();
        let req = Request { sampling: p.clone(), logprobs: Some(3), ..request(ps[i].clone(), GEN) };
        engine.add_choices(req, sinks).unwrap();
        logs.extend(choice_logs.into_iter().enumerate().map(|(c, l)| (i, p.seed + c as u64, l)));
    }
    let before = b.bytes_read_back();
    run_to_end(&mut engine);
    assert_eq!(b.bytes_read_back(), before, "bytes read back by the engine's steps");
    for (i, seed, log) in &logs {
        let events = log.lock().unwrap().clone();
        let lps = events.iter().filter(|e| matches!(e, Event::Logprobs(l) if l.top.len() == 3)).count();
        assert_eq!(lps, GEN, "request {i} seed {seed}: a logprobs event per token");
        let opts = GenerateOptions {
            max_new_tokens: GEN,
            sampling: SamplingParams { seed: *seed, ..sampling[*i].clone() },
            ..Default::default()
        };
        let host = vt::generate(&model, &ps[*i], &opts).unwrap().token_ids;
        assert_eq!(tokens(log), host, "request {i} seed {seed}");
    }
    // The count sees a read-back: the host sampler's generation above made them.
    assert!(b.bytes_read_back() >= before + GEN * 4 * model.spec().vocab);
}

fn small_engine(config: EngineConfig) -> Engine<CpuBackend> {
    Engine::new(Model::load(&CpuBackend::new(), &fixture("qwen3moe")).unwrap(), config).unwrap()
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

/// A pool too small for every admitted sequence to finish: sequences start while their prompts'
/// blocks are free, the newest are preempted when the pool runs out mid-decode and recomputed
/// later, and every one gets the greedy tokens it gets alone; a request that could never fit is
/// refused with the sizes.
#[test]
fn a_small_pool_admits_by_blocks_and_preempts_to_the_same_tokens() {
    const GEN: usize = 12;
    for dir in all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let b = CpuBackend::new();
        let model = Model::load(&b, &dir).unwrap();
        let vocab = model.spec().vocab;
        let ps: Vec<Vec<u32>> =
            (0..5).map(|i| (0..10).map(|j| ((i * 31 + j * 7 + 1) % vocab) as u32).collect()).collect();
        let opts = GenerateOptions { max_new_tokens: GEN, ..Default::default() };
        let alone: Vec<Vec<u32>> = ps.iter().map(|p| vt::generate(&model, p, &opts).unwrap().token_ids).collect();
        // Room for 4 sequences of one block's positions; each needs two to finish.
        let block = vt_core::KvOps::kv_block_size(model.backend());
        assert!(10 < block && 10 + GEN > block, "the test assumes 16-position blocks, not {block}");
        let budget = model.pool_config(4, block, 512).bytes;
        // Without the prefix cache: its snapshot slots would take from the budget, and its blocks
        // would stay used at the end.
        let config = EngineConfig {
            max_seqs: 4,
            max_context: 64 * block,
            memory_budget: Some(budget),
            prefix_cache: false,
            ..Default::default()
        };
        let mut engine = Engine::new(model, config).unwrap();
        let total = engine.pool_stats().blocks_total;
        let logs: Vec<Log> = ps
            .iter()
            .map(|p| {
                let (log, sink) = collect();
                engine.add(request(p.clone(), GEN), sink).unwrap();
                log
            })
            .collect();
        while engine.has_work() {
            engine.step();
            assert!(engine.pool_stats().blocks_used <= total);
        }
        assert!(engine.preemptions() > 0, "{name}: the pool was meant to run out");
        for (i, log) in logs.iter().enumerate() {
            assert_eq!(tokens(log), alone[i], "{name}: sequence {i}");
            assert_eq!(finish(log), Some(Finish::Length));
        }
        assert_eq!(engine.pool_stats().blocks_used, 0, "{name}: finished sequences hold no blocks");
        let err = engine.add(request(vec![1; 8], 32 * block), collect().1).unwrap_err().to_string();
        assert!(err.contains("KV blocks") && err.contains("the pool holds"), "{name}: {err}");
    }
}

/// An engine whose pool cannot hold even one short sequence is an error at start that names it.
#[test]
fn a_pool_too_small_for_one_sequence_is_refused() {
    let err = Engine::new(
        Model::load(&CpuBackend::new(), &fixture("qwen35moe_text")).unwrap(),
        EngineConfig { memory_budget: Some(1024), ..Default::default() },
    )
    .err()
    .expect("a 1 KiB pool")
    .to_string();
    assert!(err.contains("1024 bytes"), "{err}");
}

/// Engines built, run (their pools running out, sequences preempted) and dropped in turn compute
/// the same tokens each time and give all their memory back: the pool goes with its engine.
#[test]
fn engine_cycles_give_their_pool_back() {
    let b = CpuBackend::new();
    let dir = fixture("qwen35moe_text");
    let base = vt_core::Device::memory(&b);
    let mut first: Option<Vec<Vec<u32>>> = None;
    for cycle in 0..4 {
        let model = Model::load(&b, &dir).unwrap();
        let block = vt_core::KvOps::kv_block_size(model.backend());
        let budget = model.pool_config(2, block, 512).bytes;
        let config =
            EngineConfig { max_seqs: 2, max_context: 4 * block, memory_budget: Some(budget), ..Default::default() };
        let mut engine = Engine::new(model, config).unwrap();
        let logs: Vec<Log> = (0..3u32)
            .map(|i| {
                let (log, sink) = collect();
                engine.add(request((0..10).map(|j| 1 + (i * 13 + j * 5) % 200).collect(), block), sink).unwrap();
                log
            })
            .collect();
        run_to_end(&mut engine);
        assert!(engine.preemptions() > 0, "cycle {cycle}: the pool was meant to run out");
        let got: Vec<Vec<u32>> = logs.iter().map(tokens).collect();
        assert!(got.iter().all(|t| t.len() == block));
        assert_eq!(&got, first.get_or_insert_with(|| got.clone()), "cycle {cycle}: tokens differ");
        drop(engine);
        let now = vt_core::Device::memory(&b);
        assert_eq!(
            (now.bytes_live, now.blocks_live),
            (base.bytes_live, base.blocks_live),
            "cycle {cycle}: memory left"
        );
    }
}
