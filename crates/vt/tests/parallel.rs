//! The engine over a model split across CPU ranks: continuous batching, preemption (a pool that
//! runs out), forked choices and speculation give every sequence the tokens the split model
//! generates alone, and dropping the engine gives every rank's memory back, cycle after cycle.

use std::sync::{Arc, Mutex};

use vt::checkpoint::Checkpoint;
use vt::{
    AllocMode, Comms, Communicator, CpuBackend, Engine, EngineConfig, Event, GenerateOptions, HostComm, Model, Request,
    SamplingParams,
};
use vt_core::{Device, KvOps};
use vt_test_support::fixture;

type Log = Arc<Mutex<Vec<Event>>>;

fn collect() -> (Log, vt::Sink) {
    let log: Log = Arc::default();
    let l = log.clone();
    let sink: vt::Sink = Box::new(move |e| {
        l.lock().unwrap().push(e);
        true
    });
    (log, sink)
}

fn tokens(log: &Log) -> Vec<u32> {
    log.lock().unwrap().iter().filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None }).collect()
}

fn comms(n: usize) -> Comms<CpuBackend> {
    HostComm::group(n).unwrap().into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator<CpuBackend>>).collect()
}

/// Delta-net and full attention, sliding windows, plain attention with a dense block.
#[test]
fn a_split_engine_batches_preempts_and_forks_as_alone_and_gives_every_rank_its_memory_back() {
    for name in ["qwen35moe_text", "laguna_b", "qwen3moe"] {
        let ranks: Vec<CpuBackend> = (0..2).map(|_| CpuBackend::with_mode(AllocMode::PlacementArena)).collect();
        let base: Vec<_> = ranks.iter().map(Device::memory).collect();
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let load = || Model::load_ranks(&ranks, &ckpt, comms(2), false).unwrap();
        let prompts: Vec<Vec<u32>> = (0..3u32).map(|i| (0..10).map(|j| 1 + (i * 13 + j * 5) % 200).collect()).collect();
        let block = ranks[0].kv_block_size();
        let alone: Vec<Vec<u32>> = {
            let m = load();
            let opts = GenerateOptions { max_new_tokens: block, ..Default::default() };
            prompts.iter().map(|p| vt::generate(&m, p, &opts).unwrap().token_ids).collect()
        };
        let mut first: Option<Vec<Vec<u32>>> = None;
        // Cycle 1 speculates (the MTP layer drafts where the model has one, else prompt lookup):
        // every rank verifies, settles and gives its snapshots back.
        for cycle in 0..2 {
            let model = load();
            // Speculating, each sequence's verification takes a spare delta-net slot too.
            let budget = model.pool_config(2, block, 512).bytes + cycle * model.pool_config(2, 0, 512).bytes;
            let config = EngineConfig {
                max_seqs: 2,
                max_context: 4 * block,
                memory_budget: Some(budget),
                speculative_tokens: 2 * cycle,
                ..Default::default()
            };
            let mut engine = Engine::new(model, config).unwrap();
            let request = |p: &Vec<u32>| Request {
                prompt: p.clone(),
                max_tokens: block,
                sampling: SamplingParams::greedy(),
                ..Default::default()
            };
            let mut logs: Vec<Log> = Vec::new();
            for p in &prompts[..2] {
                let (log, sink) = collect();
                engine.add(request(p), sink).unwrap();
                logs.push(log);
            }
            // Two choices of one prompt: the second forks from the first's prefill on every rank.
            let (a, sa) = collect();
            let (b, sb) = collect();
            engine.add_choices(request(&prompts[2]), vec![sa, sb]).unwrap();
            logs.extend([a, b]);
            while engine.has_work() {
                engine.step();
            }
            assert!(engine.preemptions() > 0, "{name} cycle {cycle}: the pool was meant to run out");
            assert_eq!(engine.speculation_stats().0 > 0, cycle == 1, "{name} cycle {cycle}: drafts");
            let got: Vec<Vec<u32>> = logs.iter().map(tokens).collect();
            let want = [&alone[0], &alone[1], &alone[2], &alone[2]];
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g, w, "{name} cycle {cycle}: sequence {i}");
            }
            assert_eq!(&got, first.get_or_insert_with(|| got.clone()), "{name} cycle {cycle}: tokens differ");
            drop(engine);
            for (r, (b, then)) in ranks.iter().zip(&base).enumerate() {
                let now = b.memory();
                let memory = (now.bytes_live, now.blocks_live);
                assert_eq!(memory, (then.bytes_live, then.blocks_live), "{name} cycle {cycle}: rank {r}'s memory left");
            }
        }
    }
}
