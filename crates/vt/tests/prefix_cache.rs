//! The prefix cache (`prefix_cache.rs`) and forked choices (`Engine::add_choices`) on the
//! committed fixtures: a hit gives the cold run's logits bit for bit, a conversation's next turn
//! hits, eviction under a small pool changes no output, `n` forked choices give what `n` separate
//! requests with the same seeds give, and engines never see each other's cached blocks.
//!
//! The logits of a run are observed through the engine's own outputs: every token's log-softmax
//! over the whole vocabulary (`logprobs: Some(vocab)`), compared by their bits.

mod support;

use support::{collect, Log};
use vt::{CpuBackend, Engine, EngineConfig, Event, Model, Request, SamplingParams};
use vt_core::backend::prelude::*;
use vt_test_support::all_fixtures;
use vt_test_support::lifetime::moe_pairs;

/// Every event of a run as bits: tokens, and each logprob and alternative.
fn bits(log: &Log) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for e in log.lock().unwrap().iter() {
        match e {
            Event::Token(t) => out.push((u32::MAX, *t)),
            Event::Logprobs(lp) => {
                out.push((u32::MAX - 1, lp.logprob.to_bits()));
                out.extend(lp.top.iter().map(|&(id, v)| (id, v.to_bits())));
            }
            Event::Done(_) => {}
            Event::Failed(m) => panic!("a request failed: {m}"),
        }
    }
    out
}

fn tokens(log: &Log) -> Vec<u32> {
    log.lock().unwrap().iter().filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None }).collect()
}

fn name(dir: &std::path::Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

fn ids(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|j| ((j * 37 + salt * 11 + 5) % vocab) as u32).collect()
}

fn engine<B: Backend>(b: &B, dir: &std::path::Path, config: EngineConfig) -> Engine<B> {
    Engine::new(Model::load(b, dir).unwrap(), config).unwrap()
}

/// Runs `req` alone on `engine` to its end.
fn run<B: Backend>(engine: &mut Engine<B>, req: Request) -> Log {
    let (log, sink) = collect();
    engine.add(req, sink).unwrap();
    while engine.has_work() {
        engine.step();
    }
    log
}

/// Greedy, with the whole distribution of each token.
fn traced(prompt: Vec<u32>, max_tokens: usize, vocab: usize) -> Request {
    Request { prompt, max_tokens, sampling: SamplingParams::greedy(), logprobs: Some(vocab), ..Default::default() }
}

fn block_size() -> usize {
    CpuBackend::new().kv_block_size()
}

/// A prompt whose prefix is cached runs only the rest, and gives the same bits as the run that
/// computed it cold; a different prompt with that prefix gives what a fresh engine gives it.
#[test]
fn a_hit_gives_the_cold_runs_logits_bit_for_bit_on_every_fixture() {
    let block = block_size();
    let mut hit_somewhere = false;
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let mut e = engine(&b, &dir, EngineConfig::default());
        let vocab = e.model().spec().vocab;
        let p = ids(vocab, 2 * block + 5, 1);
        let cold = run(&mut e, traced(p.clone(), 4, vocab));
        let cached = e.cached_blocks();
        let hit = run(&mut e, traced(p.clone(), 4, vocab));
        let st = e.prefix_stats();
        if cached == 0 {
            // Sliding-window layers: nothing is cached (prefix_cache.rs), nothing hits.
            assert_eq!(st.hits, 0, "{}", name(&dir));
            assert_eq!(bits(&hit), bits(&cold), "{}: a second run differs", name(&dir));
            continue;
        }
        hit_somewhere = true;
        assert_eq!((st.lookups, st.hits, st.hit_tokens), (2, 1, 2 * block as u64), "{}", name(&dir));
        assert_eq!(bits(&hit), bits(&cold), "{}: the hit's logits differ from the cold run's", name(&dir));
        // Another prompt with that prefix, split at the same boundary: as a fresh engine runs it.
        let mut q = p[..2 * block].to_vec();
        q.extend(ids(vocab, 3, 9));
        let hit = run(&mut e, traced(q.clone(), 4, vocab));
        assert_eq!(e.prefix_stats().hits, 2, "{}", name(&dir));
        let cold = run(&mut engine(&b, &dir, EngineConfig::default()), traced(q, 4, vocab));
        assert_eq!(bits(&hit), bits(&cold), "{}: the hit differs from a fresh engine's run", name(&dir));
    }
    assert!(hit_somewhere, "no fixture caches prefixes");
}

/// The next turn of a conversation (the last prompt, the reply, a new message) hits past the
/// last prompt: the finished sequence's latest snapshot was cached. Its greedy reply is the one
/// an engine without the cache gives.
#[test]
fn a_conversations_next_turn_hits_its_last_reply() {
    let block = block_size();
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let mut e = engine(&b, &dir, EngineConfig::default());
        let vocab = e.model().spec().vocab;
        let first = ids(vocab, block + 4, 2);
        let gen = 2 * block;
        let reply = tokens(&run(&mut e, traced(first.clone(), gen, vocab)));
        if e.cached_blocks() == 0 {
            continue; // sliding-window layers
        }
        let second = [first.clone(), reply, ids(vocab, 5, 3)].concat();
        let before = e.prefix_stats();
        let hit = run(&mut e, traced(second.clone(), 6, vocab));
        let after = e.prefix_stats();
        // Positions run in turn one: the prompt and all but the last generated token.
        let last_boundary = (first.len() + gen - 1) / block * block;
        assert_eq!(after.hit_tokens - before.hit_tokens, last_boundary as u64, "{}", name(&dir));
        let off = EngineConfig { prefix_cache: false, ..Default::default() };
        let plain = run(&mut engine(&b, &dir, off), traced(second, 6, vocab));
        assert_eq!(tokens(&hit), tokens(&plain), "{}: greedy ids differ from an engine without the cache", name(&dir));
    }
}

/// Prompts that share a system prompt and go on differently: the second splits its prefill where
/// it leaves the first one's cached blocks and snapshots there, so the third hits there.
#[test]
fn prompts_sharing_a_system_prompt_hit_from_the_third_on() {
    let block = block_size();
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let mut e = engine(&b, &dir, EngineConfig::default());
        let vocab = e.model().spec().vocab;
        let system = ids(vocab, 2 * block + 3, 7);
        let asks: Vec<Vec<u32>> = (0..3).map(|i| [system.clone(), ids(vocab, block + 5, 20 + i)].concat()).collect();
        let mut hit_tokens = Vec::new();
        for p in &asks {
            let before = e.prefix_stats().hit_tokens;
            run(&mut e, traced(p.clone(), 2, vocab));
            hit_tokens.push(e.prefix_stats().hit_tokens - before);
        }
        if e.cached_blocks() == 0 {
            continue; // sliding-window layers
        }
        assert_eq!(hit_tokens, vec![0, 0, 2 * block as u64], "{}", name(&dir));
    }
}

/// A pool too small to keep every prefix: cached blocks are evicted (before any sequence is
/// preempted) and every request still gets the greedy ids it gets without the cache.
#[test]
fn eviction_under_a_small_pool_keeps_greedy_ids() {
    let block = block_size();
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let m = Model::load(&b, &dir).unwrap();
        let (seqs, ctx, chunk) = (2, 4 * block, 512);
        let bytes = m.pool_config(seqs, ctx, chunk).bytes + m.pool_config(2 * seqs, 0, chunk).bytes;
        let config =
            EngineConfig { max_seqs: seqs, max_context: ctx, memory_budget: Some(bytes), ..Default::default() };
        let vocab = m.spec().vocab;
        // Seven distinct prompts, three of them repeated soon after.
        let reqs: Vec<Request> = [0, 1, 0, 2, 3, 2, 4, 5, 4, 6]
            .into_iter()
            .map(|i| {
                let p = ids(vocab, 2 * block + 3, i);
                Request { prompt: p, max_tokens: 6, sampling: SamplingParams::greedy(), ..Default::default() }
            })
            .collect();
        let outputs = |mut e: Engine<CpuBackend>| {
            let logs: Vec<Log> = reqs
                .iter()
                .map(|r| {
                    let (log, sink) = collect();
                    e.add(r.clone(), sink).unwrap();
                    log
                })
                .collect();
            while e.has_work() {
                e.step();
            }
            let total = e.pool_stats().blocks_total;
            (logs.iter().map(tokens).collect::<Vec<_>>(), e.prefix_stats(), e.cached_blocks(), total)
        };
        let (cached_ids, st, held, total) = outputs(Engine::new(m, config.clone()).unwrap());
        let off = EngineConfig { prefix_cache: false, ..config };
        let (plain_ids, ..) = outputs(engine(&b, &dir, off));
        assert_eq!(cached_ids, plain_ids, "{}: greedy ids differ with the cache", name(&dir));
        if held > 0 {
            // 7 distinct prompts of 2 cached blocks each cannot all stay in the pool.
            assert!(held <= total && 7 * 2 > total, "{}: {held} cached of {total}", name(&dir));
            assert!(st.hits > 0, "{}: repeated prompts never hit", name(&dir));
        }
    }
}

/// `n = 3` choices of one request (one prefill, forked) give what three separate requests with
/// seeds seed, seed + 1, seed + 2 give, sampled at temperature 1, on every fixture.
#[test]
fn forked_choices_equal_separate_requests_with_their_seeds() {
    let block = block_size();
    for dir in all_fixtures() {
        let b = CpuBackend::new();
        let mut e = engine(&b, &dir, EngineConfig::default());
        let vocab = e.model().spec().vocab;
        // Mid-block: the forks copy the partial last block.
        let p = ids(vocab, block + block / 2 + 1, 4);
        let sampling = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
        let req = Request { prompt: p, max_tokens: 8, sampling, logprobs: Some(vocab), ..Default::default() };
        let (logs, sinks): (Vec<Log>, Vec<vt::Sink>) = (0..3).map(|_| collect()).unzip();
        e.add_choices(req.clone(), sinks).unwrap();
        let mut ran = 0;
        while e.has_work() {
            ran += e.step();
        }
        assert_eq!(ran, req.prompt.len() + 3 * 7, "{}: one prefill, then 7 decode steps a choice", name(&dir));
        let mut alone = engine(&b, &dir, EngineConfig::default());
        for (i, log) in logs.iter().enumerate() {
            let mut r = req.clone();
            r.sampling.seed += i as u64;
            let want = run(&mut alone, r);
            assert_eq!(bits(log), bits(&want), "{}: choice {i} differs from a request of its seed", name(&dir));
        }
        let distinct: std::collections::BTreeSet<Vec<u32>> = logs.iter().map(tokens).collect();
        assert!(distinct.len() > 1, "{}: the choices sampled alike; the seeds prove nothing", name(&dir));
    }
}

/// A, B, A engines (B: the variant of A's fixture, other weights) on one placement arena, each
/// dropped before the next, all given the same prompt twice: each engine's first run misses (it
/// never sees a dropped engine's cached blocks, whatever their addresses), its second hits, both
/// compute what the engine computes alone; at the end the arena holds what a fresh backend does.
#[test]
fn engines_never_hit_each_others_cached_blocks() {
    let block = block_size();
    for pair in moe_pairs() {
        let p = ids(1 << 10, 2 * block + 5, 6);
        let alone = pair.dirs().map(|d| {
            let b = CpuBackend::with_mode(vt::AllocMode::PlacementArena);
            let mut e = engine(&b, d, EngineConfig::default());
            let vocab = e.model().spec().vocab;
            bits(&run(&mut e, traced(p.iter().map(|&t| t % vocab as u32).collect(), 3, vocab)))
        });
        assert_ne!(alone[0], alone[1], "{}: the variant computes what A does; this proves nothing", pair.name);
        let shared = CpuBackend::with_mode(vt::AllocMode::PlacementArena);
        for (round, which) in [0, 1, 0].into_iter().enumerate() {
            let what = format!("{} round {round} ({})", pair.name, ["A", "B"][which]);
            let mut e = engine(&shared, pair.dirs()[which], EngineConfig::default());
            let vocab = e.model().spec().vocab;
            let prompt: Vec<u32> = p.iter().map(|&t| t % vocab as u32).collect();
            for run_no in 0..2 {
                let got = bits(&run(&mut e, traced(prompt.clone(), 3, vocab)));
                assert_eq!(got, alone[which], "{what} run {run_no}: differs from the engine alone");
                let hits = e.prefix_stats().hits;
                assert_eq!(hits, if e.cached_blocks() > 0 { run_no as u64 } else { 0 }, "{what} run {run_no}");
            }
        }
        let (m, fresh) = (shared.memory(), CpuBackend::with_mode(vt::AllocMode::PlacementArena).memory());
        assert_eq!((m.bytes_live, m.blocks_live), (fresh.bytes_live, fresh.blocks_live), "{}: memory left", pair.name);
    }
}

/// Build, run (hits and forks included), drop, many times: memory live ends where it began and
/// the peak stops growing after the first cycles.
#[test]
fn engine_cycles_with_the_cache_give_all_memory_back() {
    let block = block_size();
    let dir = &all_fixtures()[0];
    let b = CpuBackend::with_mode(vt::AllocMode::PlacementArena);
    let baseline = b.memory();
    let mut peak = 0;
    for cycle in 0..20 {
        let mut e = engine(&b, dir, EngineConfig::default());
        let vocab = e.model().spec().vocab;
        let p = ids(vocab, 2 * block + 1, 0);
        run(&mut e, traced(p.clone(), 2, vocab));
        let (_logs, sinks): (Vec<Log>, Vec<vt::Sink>) = (0..2).map(|_| collect()).unzip();
        e.add_choices(traced(p, 2, vocab), sinks).unwrap();
        while e.has_work() {
            e.step();
        }
        drop(e);
        if cycle == 1 {
            peak = b.memory().peak_bytes;
        }
    }
    let end = b.memory();
    assert_eq!((end.bytes_live, end.blocks_live), (baseline.bytes_live, baseline.blocks_live));
    assert_eq!(end.peak_bytes, peak, "peak memory grew over the cycles");
}
