//! Speculative decoding in the engine on the committed fixtures: whatever the drafter proposes
//! (a second copy of the model: nearly always right; random tokens: nearly always wrong; a mix;
//! the model's own MTP layer), greedy requests get exactly the tokens and logprobs they get
//! without speculation, with continuous batching, forks, chunked prefill and the prefix cache on
//! or off, alone or split over ranks. The built-in model's trained MTP layer drafts tokens the
//! model accepts.

mod support;

use vt_core::backend::prelude::*;

use support::collect;
use vt::{
    CpuBackend, Draft, Drafter, DrafterKind, Engine, EngineConfig, Event, Model, Observation, Proposal, Request,
    SamplingParams, SeqId,
};
use vt_test_support::all_fixtures;
use vt_test_support::parallel::{cpu_ranks, two_rank_fixtures};

/// Deterministic prompts of different lengths within the vocabulary, some repeating themselves.
fn prompts(vocab: usize, n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..3 + 5 * i).map(|j| ((i * 131 + (j % (4 + i)) * 17 + 1) % vocab) as u32).collect()).collect()
}

/// How the stand-in drafter proposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// The model's own greedy continuation (a second copy of the target).
    Model,
    /// Uniformly random tokens.
    Random,
    /// The model's continuation with every third draft replaced by a wrong token.
    Mixed,
    /// Tokens drawn from the uniform distribution, which goes with them as their `probs`.
    Uniform,
}

struct StandIn {
    kind: Kind,
    model: Model<CpuBackend>,
    rng: u64,
    /// Sequences the engine has told it about and not released (each must be observed in
    /// order: what it kept always starts where the last observation ended).
    seen: std::collections::HashMap<SeqId, usize>,
}

impl StandIn {
    fn next(&mut self) -> u64 {
        self.rng = self.rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.rng >> 33
    }

    /// The model's greedy continuation of `tokens` by `k` tokens, computed from scratch.
    fn continuation(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let b = self.model.backend();
        let mut st = self.model.new_state(tokens.len() + k).unwrap();
        let mut logits = b.to_f32(&self.model.forward(tokens, &mut st, vt::Logits::Last).unwrap()).unwrap();
        let mut out = Vec::new();
        while out.len() < k {
            let id = vt_test_support::argmax(&logits);
            out.push(id);
            if out.len() < k {
                logits = b.to_f32(&self.model.forward(&[id], &mut st, vt::Logits::Last).unwrap()).unwrap();
            }
        }
        out
    }
}

impl Drafter<CpuBackend> for StandIn {
    fn propose(&mut self, _: &Model<CpuBackend>, seqs: &mut [Proposal<'_, CpuBackend>]) -> vt::Result<Vec<Draft>> {
        let vocab = self.model.spec().vocab as u64;
        let mut out = Vec::new();
        for p in seqs {
            assert!(p.k >= 1, "asked for no drafts");
            assert_eq!(self.seen.get(&p.seq), Some(&(p.tokens.len() - 1)), "observed up to the pending token");
            let tokens = match self.kind {
                Kind::Random | Kind::Uniform => (0..p.k).map(|_| (self.next() % vocab) as u32).collect(),
                Kind::Model => self.continuation(p.tokens, p.k),
                Kind::Mixed => {
                    let mut t = self.continuation(p.tokens, p.k);
                    for x in t.iter_mut() {
                        if self.next().is_multiple_of(3) {
                            *x = (*x + 1) % vocab as u32;
                        }
                    }
                    t
                }
            };
            let probs = (self.kind == Kind::Uniform).then(|| vec![vec![1.0 / vocab as f32; vocab as usize]; p.k]);
            out.push(Draft { tokens, probs });
        }
        Ok(out)
    }

    fn observe(&mut self, _: &Model<CpuBackend>, seqs: &mut [Observation<'_, CpuBackend>]) -> vt::Result<()> {
        for o in seqs {
            // A sequence's first observation starts where the prefix cache left it.
            let at = self.seen.entry(o.seq).or_insert(o.start);
            assert_eq!(*at, o.start, "sequence {} observed from {} after {}", o.seq, o.start, *at);
            assert!(o.len >= 1 && o.start + o.len < o.tokens.len());
            *at += o.len;
        }
        Ok(())
    }

    fn fork(&mut self, _: &Model<CpuBackend>, parent: SeqId, child: SeqId) -> vt::Result<()> {
        let at = self.seen[&parent];
        self.seen.insert(child, at);
        Ok(())
    }

    fn release(&mut self, seq: SeqId) {
        self.seen.remove(&seq);
    }
}

/// The tokens of each request's events.
fn tokens(logs: &[Vec<Event>]) -> Vec<Vec<u32>> {
    logs.iter()
        .map(|l| l.iter().filter_map(|e| if let Event::Token(t) = e { Some(*t) } else { None }).collect())
        .collect()
}

/// Every event of every request (tokens, logprobs, the finish), and the engine's step count,
/// drafts verified and accepted, and prefix-cache hits. `drafter`: a stand-in, or (`None`) the
/// engine's own where `config` speculates (the MTP layer's on a model that has one).
fn run(dir: &std::path::Path, config: EngineConfig, drafter: Option<Kind>) -> Outcome {
    run_on(Model::load(&CpuBackend::new(), dir).unwrap(), dir, config, drafter)
}

/// Events, steps, (drafted, accepted) and prefix-cache hits of a run.
type Outcome = (Vec<Vec<Event>>, usize, (u64, u64), u64);

/// `run` with `model` (the model of `dir`: alone, or split over ranks) as the target.
fn run_on(model: Model<CpuBackend>, dir: &std::path::Path, config: EngineConfig, drafter: Option<Kind>) -> Outcome {
    let b = CpuBackend::new();
    let vocab = model.spec().vocab;
    let mut engine = Engine::new(model, config).unwrap();
    if let Some(kind) = drafter {
        let model = Model::load(&b, dir).unwrap();
        engine.set_drafter(Box::new(StandIn { kind, model, rng: 7, seen: Default::default() }));
    }
    let (mut logs, mut from) = (Vec::new(), Vec::new());
    let mut steps = 0;
    let ps = prompts(vocab, 6);
    for (i, p) in ps.iter().cloned().enumerate() {
        let (log, sink) = collect();
        // Two choices of one request share its prefill and fork; some ask for logprobs.
        let req = Request {
            prompt: p,
            max_tokens: 9 + 3 * i,
            sampling: SamplingParams::greedy(),
            logprobs: (i % 2 == 0).then_some(3),
            ..Default::default()
        };
        if i == 3 {
            let (log2, sink2) = collect();
            engine.add_choices(req, vec![sink, sink2]).unwrap();
            logs.push(log2);
            from.push(i);
        } else {
            engine.add(req, sink).unwrap();
        }
        logs.push(log);
        from.push(i);
        // Later requests join a batch that is already decoding.
        if i % 2 == 1 {
            engine.step();
            engine.step();
            steps += 2;
        }
    }
    while engine.has_work() {
        engine.step();
        steps += 1;
    }
    // A second turn of each conversation: its prompt, reply and a new message (prefix-cache
    // hits where the cache is on).
    let firsts: Vec<Vec<u32>> = tokens(&logs.iter().map(|l| l.lock().unwrap().clone()).collect::<Vec<_>>());
    for (&i, reply) in from.iter().zip(&firsts) {
        let (log, sink) = collect();
        let prompt = [ps[i].as_slice(), reply, &[1, 2, 3]].concat();
        engine.add(Request { prompt, max_tokens: 12, logprobs: Some(2), ..Default::default() }, sink).unwrap();
        logs.push(log);
    }
    while engine.has_work() {
        engine.step();
        steps += 1;
    }
    let stats = engine.speculation_stats();
    (logs.iter().map(|l| l.lock().unwrap().clone()).collect(), steps, stats, engine.prefix_stats().hits)
}

#[test]
fn greedy_output_with_speculation_equals_without_on_every_fixture() {
    for dir in all_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        for (prefix_cache, max_batch_tokens) in [(true, 512), (false, 512), (true, 7)] {
            let plain = EngineConfig { prefix_cache, max_batch_tokens, ..Default::default() };
            let (want, plain_steps, _, _) = run(&dir, plain.clone(), None);
            for (kind, k) in [(Kind::Model, 3), (Kind::Random, 3), (Kind::Mixed, 1), (Kind::Mixed, 3)] {
                let config = EngineConfig { speculative_tokens: k, ..plain.clone() };
                let (got, steps, (drafted, accepted), hits) = run(&dir, config, Some(kind));
                let at =
                    format!("{name}: {kind:?} drafter, k {k}, prefix cache {prefix_cache}, chunk {max_batch_tokens}");
                if max_batch_tokens >= 512 {
                    assert!(got == want, "{at}: the events differ from decoding without speculation");
                } else {
                    // Prompt chunks then depend on what the decodes and drafts left of each
                    // step's budget, and a different chunking rounds differently (as it does
                    // without speculation, for requests that arrive at other times): the
                    // tokens must still agree.
                    assert_eq!(tokens(&got), tokens(&want), "{at}: the tokens differ");
                }
                assert!(drafted > 0, "{at}: nothing was drafted");
                let caches = prefix_cache && !name.starts_with("laguna"); // sliding windows: no cache
                assert_eq!(hits > 0, caches, "{at}: {hits} prefix-cache hits");
                match kind {
                    // Nearly every draft is the target's own token: far fewer steps.
                    Kind::Model => assert!(
                        accepted * 10 >= drafted * 8 && steps < plain_steps,
                        "{at}: accepted {accepted} of {drafted} in {steps} steps (plain {plain_steps})"
                    ),
                    Kind::Random | Kind::Uniform => {
                        assert!(accepted * 4 < drafted, "{at}: accepted {accepted} of {drafted}")
                    }
                    Kind::Mixed => {}
                }
            }
        }
    }
}

/// Split over 2 ranks (tensor-, then expert-parallel), the target verifies and settles on every
/// rank, and the MTP layer drafts on every rank: with a stand-in drafter (some drafts wrong),
/// prompt lookup, and the MTP layer where the fixture has one, greedy requests get exactly the
/// events (tokens and logprobs) the split model gets without speculation, and the tokens the
/// model gets alone, from the drafts it gets alone.
#[test]
fn split_models_speculate_as_one_rank_decodes() {
    for dir in two_rank_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (alone, _, _, _) = run(&dir, EngineConfig::default(), None);
        let has_mtp = Model::load(&CpuBackend::new(), &dir).unwrap().has_mtp();
        for ep in [false, true] {
            let (want, _, _, _) = run_on(cpu_ranks(&dir, 2, ep), &dir, EngineConfig::default(), None);
            assert_eq!(tokens(&want), tokens(&alone), "{name}, expert-parallel {ep}: split differs from alone");
            let mut drafters = vec![(Some(Kind::Mixed), DrafterKind::Auto), (None, DrafterKind::Ngram)];
            if has_mtp {
                drafters.push((None, DrafterKind::Mtp));
            }
            for (kind, drafter) in drafters {
                let config = EngineConfig { speculative_tokens: 3, drafter, ..Default::default() };
                let (got, _, (drafted, accepted), _) = run_on(cpu_ranks(&dir, 2, ep), &dir, config.clone(), kind);
                let at = format!("{name} over 2 ranks, expert-parallel {ep}: {kind:?} drafter ({drafter:?})");
                assert!(got == want, "{at}: the events differ from decoding without speculation");
                assert!(drafted > 0, "{at}: nothing was drafted");
                // The same drafts as on one rank (the MTP layer's too), so the same accepted; a
                // split model caches no prefixes, whose blocks bound a step's drafts.
                let (_, _, one_rank, _) = run(&dir, EngineConfig { prefix_cache: false, ..config }, kind);
                assert_eq!((drafted, accepted), one_rank, "{at}: drafted and accepted, against one rank");
                println!("{at}: accepted {accepted} of {drafted}");
            }
        }
    }
}

/// Sampled requests run through the rejection rule (its distribution is tested in
/// `acceptance.rs`): with a drafter that is always right and one that never is, every request
/// gets its tokens and finishes.
#[test]
fn sampled_requests_speculate() {
    let dir = vt_test_support::fixture("qwen35moe_text");
    let b = CpuBackend::new();
    for kind in [Kind::Model, Kind::Random] {
        let config = EngineConfig { speculative_tokens: 3, prefix_cache: false, ..Default::default() };
        let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), config).unwrap();
        let model = Model::load(&b, &dir).unwrap();
        let vocab = model.spec().vocab;
        engine.set_drafter(Box::new(StandIn { kind, model, rng: 3, seen: Default::default() }));
        let mut logs = Vec::new();
        for (i, p) in prompts(vocab, 4).into_iter().enumerate() {
            let (log, sink) = collect();
            let sampling = SamplingParams {
                temperature: 0.8,
                top_k: 20,
                presence_penalty: 0.3,
                seed: i as u64,
                ..Default::default()
            };
            engine
                .add(Request { prompt: p, max_tokens: 20, sampling, logprobs: Some(1), ..Default::default() }, sink)
                .unwrap();
            logs.push(log);
        }
        while engine.has_work() {
            engine.step();
        }
        for log in logs {
            let log = log.lock().unwrap();
            let tokens = log.iter().filter(|e| matches!(e, Event::Token(_))).count();
            let logprobs = log.iter().filter(|e| matches!(e, Event::Logprobs(_))).count();
            assert_eq!((tokens, logprobs), (20, 20), "{kind:?}: {log:?}");
            assert_eq!(log.last(), Some(&Event::Done(vt::Finish::Length)));
        }
        assert!(engine.speculation_stats().0 > 0);
        // No verification's snapshot slot is left taken.
        assert_eq!(engine.pool_stats().slots_used, engine.kept_states());
    }
}

/// The engine's own drafter on the fixtures with an MTP layer (both checkpoint layouts): greedy
/// requests of different lengths, decoding together, forking (n = 2) and coming back for a second
/// turn (prefix-cache hits, after which the MTP reads its KV of the cached blocks), get exactly
/// the events they get without speculation, for 1 to 4 drafts a step.
#[test]
fn mtp_drafter_keeps_greedy_output() {
    for dir in vt_test_support::mtp::mtp_fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert!(Model::load(&CpuBackend::new(), &dir).unwrap().has_mtp(), "{name}");
        for prefix_cache in [true, false] {
            let plain = EngineConfig { prefix_cache, ..Default::default() };
            let (want, _, _, _) = run(&dir, plain.clone(), None);
            for k in 1..=4 {
                let config = EngineConfig { speculative_tokens: k, drafter: DrafterKind::Mtp, ..plain.clone() };
                let (got, _, (drafted, accepted), hits) = run(&dir, config, None);
                let at = format!("{name}: MTP drafter, k {k}, prefix cache {prefix_cache}");
                assert!(got == want, "{at}: the events differ from decoding without speculation");
                assert!(drafted > 0, "{at}: nothing was drafted");
                assert_eq!(hits > 0, prefix_cache, "{at}: {hits} prefix-cache hits");
                println!("{at}: accepted {accepted} of {drafted}");
            }
        }
    }
}

/// Greedy tokens of `prompts` on the built-in model through an engine of `config` (its own
/// drafter), run one after the other; with the drafts proposed and accepted of each, and the
/// prefix-cache hits of all.
type Runs = (Vec<(Vec<u32>, (u64, u64))>, u64);
fn builtin_runs(config: EngineConfig, prompts: &[Vec<u32>], max_tokens: usize) -> Runs {
    let b = CpuBackend::new();
    let model = Model::load(&b, &vt_test_support::repo_root().join("models/default")).unwrap();
    let mut engine = Engine::new(model, config).unwrap();
    let mut out = Vec::new();
    for p in prompts {
        let (log, sink) = collect();
        let before = engine.speculation_stats();
        let req = Request { prompt: p.clone(), max_tokens, sampling: SamplingParams::greedy(), ..Default::default() };
        engine.add(req, sink).unwrap();
        while engine.has_work() {
            engine.step();
        }
        let (d, a) = engine.speculation_stats();
        let toks = tokens(&[log.lock().unwrap().clone()]).remove(0);
        out.push((toks, (d - before.0, a - before.1)));
    }
    (out, engine.prefix_stats().hits)
}

/// Real text in the built-in model's tokens.
fn builtin_prompts() -> Vec<Vec<u32>> {
    let tok = vt::Tokenizer::load(&vt_test_support::repo_root().join("models/default")).unwrap().unwrap();
    [
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n",
        "import os\nimport sys\n\n\ndef main():\n    parser = argparse.ArgumentParser(",
        "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    ]
    .iter()
    .map(|t| tok.encode(t, false).unwrap())
    .collect()
}

/// The built-in model's MTP layer was trained to predict the model's token after next
/// (tools/train_default/train_mtp.py): on real text the model accepts a good share of its drafts,
/// and the output is the model's own greedy output.
#[test]
fn builtin_mtp_drafts_are_accepted() {
    let prompts = builtin_prompts();
    let (plain, _) = builtin_runs(EngineConfig::default(), &prompts, 48);
    for k in 1..=3 {
        let config = EngineConfig { speculative_tokens: k, ..Default::default() };
        let (runs, _) = builtin_runs(config, &prompts, 48);
        let (mut drafted, mut accepted) = (0, 0);
        for ((got, (d, a)), (want, _)) in runs.iter().zip(&plain) {
            assert_eq!(got, want, "k {k}: the tokens differ from decoding without speculation");
            drafted += d;
            accepted += a;
        }
        println!("built-in model, k {k}: accepted {accepted} of {drafted} drafts");
        assert!(accepted * 4 > drafted, "k {k}: accepted {accepted} of {drafted}");
    }
}

/// A prompt that hits the prefix cache drafts exactly as its cold run did: the MTP's KV of the
/// cached blocks is what the cold run fed it (a drafter that lost it, or read another prompt's,
/// would draft differently), and the tokens after the cached prefix continue its feed.
#[test]
fn mtp_drafts_after_a_prefix_cache_hit_equal_the_cold_run() {
    let prompts = builtin_prompts();
    // Each prompt twice: its second run starts from the cache.
    let twice: Vec<Vec<u32>> = prompts.iter().flat_map(|p| [p.clone(), p.clone()]).collect();
    let config = EngineConfig { speculative_tokens: 3, ..Default::default() };
    let (runs, hits) = builtin_runs(config, &twice, 40);
    assert_eq!(hits, prompts.len() as u64, "each prompt's second run hits the cache");
    let b = CpuBackend::new();
    let model = Model::load(&b, &vt_test_support::repo_root().join("models/default")).unwrap();
    let block = vt_core::KvOps::kv_block_size(model.backend());
    for (p, pair) in prompts.iter().zip(runs.chunks(2)) {
        assert!(p.len() > block, "a prompt of {} tokens caches no block of {block}", p.len());
        let ((cold, cold_stats), (hit, hit_stats)) = (&pair[0], &pair[1]);
        assert_eq!(hit, cold);
        assert!(cold_stats.1 > 0, "no draft accepted: {cold_stats:?}");
        assert_eq!(hit_stats, cold_stats, "drafts accepted after the hit differ from the cold run's");
    }
}

/// The built-in model (it has a tokenizer, for grammars) with a JSON schema's grammar compiler,
/// its stop token and the schema.
struct Json {
    tok: vt::Tokenizer,
    compiler: vt::grammar::GrammarCompiler,
    eos: u32,
    spec: vt::grammar::ConstraintSpec,
}

impl Json {
    fn new() -> Json {
        let dir = vt_test_support::repo_root().join("models/default");
        let tok = vt::Tokenizer::load(&dir).unwrap().unwrap();
        let eos = tok.eos_id().unwrap();
        let vocab = Model::load(&CpuBackend::new(), &dir).unwrap().spec().vocab;
        let compiler = tok.grammar_compiler(&[eos], vocab).unwrap();
        let spec = vt::grammar::ConstraintSpec::JsonSchema(serde_json::json!({"type": "object", "properties": {
            "a": {"type": "string", "maxLength": 6}, "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
            "required": ["a", "b"], "additionalProperties": false}));
        Json { tok, compiler, eos, spec }
    }

    fn request(&self, text: &str, constrained: bool, sampling: SamplingParams) -> Request {
        Request {
            prompt: self.tok.encode(text, false).unwrap(),
            max_tokens: 60,
            sampling,
            stop_token_ids: vec![self.eos],
            grammar: constrained.then(|| self.compiler.compile(&self.spec).unwrap()),
            logprobs: constrained.then_some(2),
        }
    }

    /// `out`, where it ends with the stop token, is valid under the schema.
    fn check(&self, out: &[u32], at: &str) -> bool {
        let Some((&last, text)) = out.split_last() else { return false };
        if last != self.eos {
            return false;
        }
        let text = self.tok.decode(text).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{at}: {text:?}: {e}"));
        let ok = v["a"].as_str().is_some_and(|a| a.chars().count() <= 6)
            && v["b"].as_array().is_some_and(|b| b.len() <= 3 && b.iter().all(|x| x.is_i64()))
            && v.as_object().unwrap().len() == 2;
        assert!(ok, "{at}: {text}");
        true
    }

    /// Every event of three constrained greedy requests and an unconstrained one, batched; one
    /// constrained request arrives while the others decode, with a sampled unconstrained one
    /// (its tokens are drawn by `sample_rows` beside the others' greedy rows, verified under
    /// their masks; its events are not returned). `host`: one constrained request has a (zero)
    /// logit bias, which makes its verifications read their logits back. With the drafts
    /// verified and accepted.
    fn run(&self, config: EngineConfig, drafter: Option<Kind>, host: bool) -> (Vec<Vec<Event>>, (u64, u64)) {
        let b = CpuBackend::new();
        let dir = vt_test_support::repo_root().join("models/default");
        let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), config).unwrap();
        if let Some(kind) = drafter {
            let model = Model::load(&b, &dir).unwrap();
            engine.set_drafter(Box::new(StandIn { kind, model, rng: 11, seen: Default::default() }));
        }
        let biased = SamplingParams { logit_bias: if host { vec![(0, 0.0)] } else { vec![] }, ..Default::default() };
        let first = [
            self.request("JSON please:", true, SamplingParams::greedy()),
            self.request("An object", true, biased),
            self.request("def main():", false, SamplingParams::greedy()),
        ];
        let mut logs = Vec::new();
        for req in first {
            let (log, sink) = collect();
            engine.add(req, sink).unwrap();
            logs.push(log);
        }
        engine.step();
        engine.step();
        let (log, sink) = collect();
        engine.add(self.request("Give me JSON:", true, SamplingParams::greedy()), sink).unwrap();
        logs.push(log);
        // Two tokens: it never verifies (its last token is never run), so these steps' verified
        // rows are all greedy and picked by `sample_rows`.
        let hot = SamplingParams { temperature: 1.0, seed: 5, ..Default::default() };
        engine.add(Request { max_tokens: 2, ..self.request("Hello", false, hot) }, collect().1).unwrap();
        while engine.has_work() {
            engine.step();
        }
        (logs.iter().map(|l| l.lock().unwrap().clone()).collect(), engine.speculation_stats())
    }
}

/// Sequences under a grammar speculate, each verified row under the grammar's state after the
/// drafts before it, and get exactly the events they get without speculation, whatever the
/// drafter proposes (the model's unconstrained continuation, which the grammar sometimes
/// forbids; random tokens, nearly all forbidden; a mix; the MTP layer; prompt lookup), with the
/// picks made on the backend (`argmax_rows`, `sample_rows`) or on the host. The outputs are
/// valid under the schema: the grammar ends having accepted exactly the emitted tokens.
#[test]
fn constrained_output_with_speculation_equals_without() {
    let json = Json::new();
    for host in [false, true] {
        let (want, _) = json.run(EngineConfig::default(), None, host);
        let complete =
            (want.iter().enumerate()).filter(|(i, l)| *i != 2 && json.check(&tokens(&[l.to_vec()])[0], "plain"));
        assert!(complete.count() >= 2, "host {host}: the plain run completes too few outputs to compare: {want:?}");
        let drafters = [Kind::Model, Kind::Random, Kind::Mixed].map(Some).into_iter().chain([None]);
        for drafter in drafters {
            let kinds = match drafter {
                Some(_) => vec![DrafterKind::Auto],
                None => vec![DrafterKind::Mtp, DrafterKind::Ngram],
            };
            for (kind, k) in kinds.into_iter().flat_map(|kind| (1..=3).map(move |k| (kind, k))) {
                let config = EngineConfig { speculative_tokens: k, drafter: kind, ..Default::default() };
                let (got, (drafted, accepted)) = json.run(config, drafter, host);
                let at = format!("host {host}, drafter {drafter:?} {kind:?}, k {k}");
                assert!(got == want, "{at}: the events differ from decoding without speculation");
                for (i, out) in tokens(&got).iter().enumerate().filter(|(i, _)| *i != 2) {
                    json.check(out, &format!("{at}, request {i}"));
                }
                println!("{at}: accepted {accepted} of {drafted}");
                if drafter == Some(Kind::Model) || kind == DrafterKind::Mtp {
                    assert!(accepted > 0, "{at}: accepted {accepted} of {drafted}");
                }
            }
        }
    }
}

/// A lone constrained request speculates: the model's own continuation is accepted where the
/// grammar allows it, while random drafts, which it nearly always forbids, are cut at the first
/// forbidden one and barely reach the verification.
#[test]
fn constrained_sequences_speculate_and_skip_forbidden_drafts() {
    let json = Json::new();
    let b = CpuBackend::new();
    let dir = vt_test_support::repo_root().join("models/default");
    for kind in [Kind::Model, Kind::Random] {
        let config = EngineConfig { speculative_tokens: 3, ..Default::default() };
        let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), config).unwrap();
        let model = Model::load(&b, &dir).unwrap();
        engine.set_drafter(Box::new(StandIn { kind, model, rng: 5, seen: Default::default() }));
        let (log, sink) = collect();
        engine.add(json.request("JSON please:", true, SamplingParams::greedy()), sink).unwrap();
        let mut steps = 0;
        while engine.has_work() {
            engine.step();
            steps += 1;
        }
        let out = tokens(&[log.lock().unwrap().clone()]).remove(0);
        assert!(json.check(&out, &format!("{kind:?}")), "{kind:?}: incomplete {out:?}");
        let (drafted, accepted) = engine.speculation_stats();
        println!("{kind:?}: {} tokens in {steps} steps, accepted {accepted} of {drafted}", out.len());
        match kind {
            Kind::Model => assert!(accepted > 0 && steps < out.len(), "{kind:?}: accepted {accepted} of {drafted}"),
            // Uncut, every decode step would verify 3.
            _ => assert!(drafted < out.len() as u64, "{kind:?}: {drafted} drafts verified for {} tokens", out.len()),
        }
    }
}

/// Sampled requests under a grammar speculate and keep to it. A draft drawn from a distribution
/// that the grammar forbids is still verified at its row (rejected there, the token drawn from
/// the residual of p and q, as the acceptance rule has it: `acceptance.rs`), so every decode step
/// of the uniform drafter verifies at least one draft; the model's drafts are point masses.
#[test]
fn sampled_constrained_requests_speculate_and_keep_the_schema() {
    let json = Json::new();
    let b = CpuBackend::new();
    let dir = vt_test_support::repo_root().join("models/default");
    let mut complete = 0;
    for kind in [Kind::Uniform, Kind::Model] {
        for seed in 0..3 {
            let config = EngineConfig { speculative_tokens: 2, ..Default::default() };
            let mut engine = Engine::new(Model::load(&b, &dir).unwrap(), config).unwrap();
            let model = Model::load(&b, &dir).unwrap();
            engine.set_drafter(Box::new(StandIn { kind, model, rng: seed, seen: Default::default() }));
            let (log, sink) = collect();
            let hot = SamplingParams { temperature: 1.0, seed, ..Default::default() };
            engine.add(json.request("JSON please:", true, hot), sink).unwrap();
            while engine.has_work() {
                engine.step();
            }
            let out = tokens(&[log.lock().unwrap().clone()]).remove(0);
            let at = format!("{kind:?}, seed {seed}");
            complete += usize::from(json.check(&out, &at));
            let (drafted, accepted) = engine.speculation_stats();
            println!("{at}: {} tokens, accepted {accepted} of {drafted}", out.len());
            assert!(drafted > 0, "{at}: nothing verified");
            if kind == Kind::Uniform {
                // One decode step per token but the first, less those the accepted drafts saved.
                assert!(
                    drafted + accepted + 1 >= out.len() as u64,
                    "{at}: {drafted} verified for {} tokens",
                    out.len()
                );
            }
        }
    }
    assert!(complete > 0, "no output completed");
}
