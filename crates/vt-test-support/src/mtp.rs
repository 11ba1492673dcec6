//! The MTP draft bodies, generic over the backend: `Model::draft` against the f32 reference of
//! tools/oracle/mtp.py (`mtp_reference.safetensors` beside a fixture's reference) under the f32
//! rule. Each f32 backend's tests run them, on the model `load` makes of a fixture (vt-models'
//! tests/mtp.rs on the CPU, alone and split over ranks).

use std::path::{Path, PathBuf};

use half::bf16;
use vt_core::backend::Backend;
use vt_core::checkpoint::TensorStore;
use vt_core::{DType, Tensor};
use vt_models::{DraftInput, Logits, Model, SeqState};

use crate::{all_fixtures, argmax, max_abs_diff, top2_gap, LOGIT_TOL};

/// What tools/oracle/mtp.py computed for a fixture's MTP layer.
pub struct MtpReference {
    /// `[rows, hidden]`: the model's last hidden states (before its final norm) over the fixture's
    /// sequence.
    pub hidden: Vec<f32>,
    pub width: usize,
    /// The token after each row.
    pub next_ids: Vec<u32>,
    /// `[rows, vocab]`: the MTP's logits of each row fed with `hidden` and `next_ids`.
    pub feed_logits: Vec<f32>,
    pub vocab: usize,
    /// The greedy chain after row `draft_start`.
    pub draft_start: usize,
    pub draft_ids: Vec<u32>,
    pub draft_logits: Vec<f32>,
}

pub const FILE: &str = "mtp_reference.safetensors";

impl MtpReference {
    pub fn load(dir: &Path) -> MtpReference {
        let store = TensorStore::open_files(dir, &[dir.join(FILE)]).expect(FILE);
        let f32s = |n: &str| store.get(n).unwrap().to_f32_vec().unwrap();
        let ids =
            |n: &str| store.get(n).unwrap().to_i64_vec().unwrap().into_iter().map(|x| x as u32).collect::<Vec<_>>();
        MtpReference {
            hidden: f32s("hidden"),
            width: store.get("hidden").unwrap().shape[1],
            next_ids: ids("next_ids"),
            feed_logits: f32s("feed_logits"),
            vocab: store.get("feed_logits").unwrap().shape[1],
            draft_start: ids("draft_start")[0] as usize,
            draft_ids: ids("draft_ids"),
            draft_logits: f32s("draft_logits"),
        }
    }

    pub fn feed_row(&self, i: usize) -> &[f32] {
        &self.feed_logits[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Hidden-state rows `rows` on `b`, in its activation dtype.
    pub fn hidden_rows<B: Backend>(&self, b: &B, rows: std::ops::Range<usize>) -> Tensor<B> {
        let vals = &self.hidden[rows.start * self.width..rows.end * self.width];
        let shape = [rows.len(), self.width];
        match b.activation_dtype() {
            DType::BF16 => {
                let bytes: Vec<u8> = vals.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
                b.upload(DType::BF16, &shape, &bytes).unwrap()
            }
            _ => b.upload(DType::F32, &shape, &vals.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()).unwrap(),
        }
    }

    /// The sequence the model ran: the first token, then every row's next token.
    fn tokens(&self, first: u32) -> Vec<u32> {
        std::iter::once(first).chain(self.next_ids.iter().copied()).collect()
    }
}

/// Fixtures that carry an MTP layer and its reference (at least two: both checkpoint layouts).
pub fn mtp_fixtures() -> Vec<PathBuf> {
    let dirs: Vec<PathBuf> = all_fixtures().into_iter().filter(|d| d.join(FILE).exists()).collect();
    assert!(dirs.len() >= 2, "fixtures with an MTP reference missing: {dirs:?}");
    dirs
}

fn name(dir: &Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// Runs the model over the first `n` tokens of the fixture's sequence (the MTP needs the
/// sequence to have these positions).
fn run_target<B: Backend>(m: &Model<B>, dir: &Path, r: &MtpReference, st: &mut SeqState<B>, n: usize) {
    let first = crate::Reference::load(dir).prompt_ids[0];
    m.forward(&r.tokens(first)[..n], st, Logits::Last).unwrap();
}

/// Feeds `rows` of the reference to `st` and drafts `k`; returns (tokens, logits as f32).
fn feed<B: Backend>(
    m: &Model<B>,
    r: &MtpReference,
    st: &mut SeqState<B>,
    rows: std::ops::Range<usize>,
    k: usize,
) -> (Vec<u32>, Vec<f32>) {
    let b = m.backend();
    assert_eq!(st.mtp_len(), rows.start, "fed rows must start where the MTP is");
    let hidden = r.hidden_rows(b, rows.clone());
    let mut d =
        m.draft(&mut [DraftInput { state: st, hidden: Some(&hidden), next: &r.next_ids[rows.clone()] }], k).unwrap();
    assert_eq!(st.mtp_len(), rows.end);
    match d.pop() {
        Some(d) => (d.tokens, b.to_f32(&d.logits).unwrap()),
        None => (Vec::new(), Vec::new()),
    }
}

/// Compares a chain with the reference's: logits within `LOGIT_TOL`, tokens equal up to a
/// reference near tie (after which the chains cannot be compared).
fn check_chain(what: &str, r: &MtpReference, tokens: &[u32], logits: &[f32]) {
    assert_eq!(tokens.len(), r.draft_ids.len(), "{what}: draft count");
    let d = max_abs_diff(logits, &r.draft_logits);
    println!("{what}: {} drafts {tokens:?}, max |dlogit| = {d:.3e}", tokens.len());
    for (j, (&ours, &want)) in tokens.iter().zip(&r.draft_ids).enumerate() {
        let row = &r.draft_logits[j * r.vocab..(j + 1) * r.vocab];
        assert_eq!(argmax(&logits[j * r.vocab..(j + 1) * r.vocab]), ours, "{what}: draft {j} is not its row's argmax");
        if ours != want {
            assert!(top2_gap(row) < LOGIT_TOL, "{what}: draft {j} is {ours}, reference {want}");
            return;
        }
    }
    assert!(d <= LOGIT_TOL, "{what}: max |dlogit| {d} > {LOGIT_TOL}");
}

/// Drafts `k` from the output the state kept at its last fed position (no rows fed).
fn chain<B: Backend>(m: &Model<B>, st: &mut SeqState<B>, k: usize) -> vt_core::Result<(Vec<u32>, Vec<f32>)> {
    let mut d = m.draft(&mut [DraftInput { state: st, hidden: None, next: &[] }], k)?;
    let d = d.pop().expect("one sequence, one draft");
    Ok((d.tokens, m.backend().to_f32(&d.logits).unwrap()))
}

/// The prompt's rows fed at once, then a chain of drafts: the reference's chain; the same when the
/// chain starts in a later call, from the output the feed kept. Once the MTP is cut back, that
/// output is gone, and a chain without rows is refused.
pub fn draft_matches_reference<B: Backend>(load: impl Fn(&Path) -> Model<B>) {
    for dir in mtp_fixtures() {
        let r = MtpReference::load(&dir);
        let m = load(&dir);
        assert!(m.has_mtp(), "{}: the MTP layer was not loaded", name(&dir));
        let n = r.draft_start + 1;
        let mut st = m.new_state(4096).unwrap();
        run_target(&m, &dir, &r, &mut st, n);
        let (tokens, logits) = feed(&m, &r, &mut st, 0..n, r.draft_ids.len());
        check_chain(&name(&dir), &r, &tokens, &logits);

        m.reset_state(&mut st).unwrap();
        assert!(!st.mtp_ready(), "a reset state keeps no MTP output");
        run_target(&m, &dir, &r, &mut st, n);
        assert!(chain(&m, &mut st, 1).is_err(), "nothing fed: no output to chain from");
        feed(&m, &r, &mut st, 0..n, 0);
        assert!(st.mtp_ready());
        assert!(chain(&m, &mut st, 0).is_err(), "no rows and no drafts is refused");
        let (tokens, logits) = chain(&m, &mut st, r.draft_ids.len()).unwrap();
        check_chain(&format!("{} chained in a later call", name(&dir)), &r, &tokens, &logits);
        st.cut_mtp(n - 1);
        assert!(!st.mtp_ready() && chain(&m, &mut st, 1).is_err(), "a cut MTP keeps no output");
    }
}

/// Rows fed in pieces equal rows fed at once, and rows fed after a chain (whose KV was scratch)
/// equal the reference's teacher-forced rows: the state after a rejected draft is right.
pub fn draft_after_pieces_and_a_rejected_chain<B: Backend>(load: impl Fn(&Path) -> Model<B>) {
    for dir in mtp_fixtures() {
        let r = MtpReference::load(&dir);
        let m = load(&dir);
        let (n, rows) = (r.draft_start + 1, r.next_ids.len());
        let mut st = m.new_state(4096).unwrap();
        run_target(&m, &dir, &r, &mut st, rows);
        assert!(feed(&m, &r, &mut st, 0..3, 0).0.is_empty());
        let (tokens, logits) = feed(&m, &r, &mut st, 3..n, r.draft_ids.len());
        check_chain(&format!("{} fed in two pieces", name(&dir)), &r, &tokens, &logits);
        let mut worst = 0f32;
        for (a, z) in [(n, n + 3), (n + 3, n + 4), (n + 4, rows)] {
            let (t, l) = feed(&m, &r, &mut st, a..z, 1);
            assert_eq!(t, vec![argmax(&l)]);
            worst = worst.max(max_abs_diff(&l, r.feed_row(z - 1)));
        }
        println!("{}: rows {n}..{rows} after a chain, max |dlogit| = {worst:.3e}", name(&dir));
        assert!(worst <= LOGIT_TOL, "{}: max |dlogit| {worst} > {LOGIT_TOL}", name(&dir));
        m.reset_state(&mut st).unwrap();
        assert_eq!(st.mtp_len(), 0);
    }
}

/// Three sequences of one pool drafted in one call (one fed many rows, one a single row, one none:
/// it chains from the output its earlier feed kept) each get what they get alone.
pub fn batched_drafts_match_reference<B: Backend>(load: impl Fn(&Path) -> Model<B>) {
    for dir in mtp_fixtures() {
        let r = MtpReference::load(&dir);
        let m = load(&dir);
        let b = m.backend();
        let n = r.draft_start + 1;
        let pool = m.new_pool(&m.pool_config(3, 4096, 4096)).unwrap();
        let (mut a, mut c, mut e) = (pool.new_state().unwrap(), pool.new_state().unwrap(), pool.new_state().unwrap());
        run_target(&m, &dir, &r, &mut a, n);
        run_target(&m, &dir, &r, &mut c, n + 5);
        feed(&m, &r, &mut c, 0..n + 4, 0);
        run_target(&m, &dir, &r, &mut e, n + 3);
        feed(&m, &r, &mut e, 0..n + 3, 0);
        let (ha, hc) = (r.hidden_rows(b, 0..n), r.hidden_rows(b, n + 4..n + 5));
        let k = r.draft_ids.len();
        let drafts = m
            .draft(
                &mut [
                    DraftInput { state: &mut a, hidden: Some(&ha), next: &r.next_ids[..n] },
                    DraftInput { state: &mut c, hidden: Some(&hc), next: &r.next_ids[n + 4..n + 5] },
                    DraftInput { state: &mut e, hidden: None, next: &[] },
                ],
                k,
            )
            .unwrap();
        let la = b.to_f32(&drafts[0].logits).unwrap();
        check_chain(&format!("{} batched", name(&dir)), &r, &drafts[0].tokens, &la);
        let lc = b.to_f32(&drafts[1].logits).unwrap();
        assert_eq!(drafts[1].tokens.len(), k);
        let d = max_abs_diff(&lc[..r.vocab], r.feed_row(n + 4));
        assert!(d <= LOGIT_TOL, "{} batched, second sequence: max |dlogit| {d}", name(&dir));
        let le = b.to_f32(&drafts[2].logits).unwrap();
        assert_eq!(drafts[2].tokens.len(), k);
        let d = max_abs_diff(&le[..r.vocab], r.feed_row(n + 2));
        assert!(d <= LOGIT_TOL, "{} batched, third sequence: max |dlogit| {d}", name(&dir));
        assert_eq!((a.mtp_len(), c.mtp_len(), e.mtp_len()), (n, n + 5, n + 3));
    }
}
