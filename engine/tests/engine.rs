//! The engine's API on a tiny model made at test time (tools/model_dir.py: random weights, a
//! tokenizer trained on the spot): early ends (end-of-sequence ids, stop strings) and aborts
//! free their blocks at once, as the block manager's statistics show; a refused request fails
//! alone; preemption and forks give what an undisturbed run gives; speculative decoding changes
//! neither greedy ids nor what the block manager holds afterwards, with prompt lookup or a draft
//! model. Token equality with OpenVINO
//! GenAI is tests/python/test_engine.py's.

use paged_attention::ElemType;
use paged_attention_engine::{
    DraftLength, EngineConfig, EngineCore as Engine, EngineError, Event, FinishReason,
    GenerationParams, KvCacheSize, Precision, Sampling, SpeculativeConfig, SpeculativeMethod,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The gqa4 tiny model directory, written once per test run (beside gqa1's, a draft model with
/// the same tokenizer and other random weights).
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = std::env::temp_dir().join(format!("pa_engine_test_{}", std::process::id()));
        let py = repo().join(".venv/bin/python");
        assert!(
            py.is_file(),
            "{} missing: run scripts/setup.sh",
            py.display()
        );
        let st = std::process::Command::new(py)
            .arg(repo().join("tools/model_dir.py"))
            .arg(&out)
            .args(["--variant", "gqa4", "--variant", "gqa1"])
            .output()
            .expect("run tools/model_dir.py");
        assert!(
            st.status.success(),
            "tools/model_dir.py failed: {}",
            String::from_utf8_lossy(&st.stderr)
        );
        out.join("gqa4")
    })
}

fn config(kv_bytes: usize) -> EngineConfig {
    EngineConfig {
        cache_type: ElemType::F32,
        kv_cache: KvCacheSize::Bytes(kv_bytes),
        block_size: 32,
        max_batched_tokens: 64,
        max_seqs: 16,
        prefix_caching: true,
        precision: Some(Precision::F32),
        threads: Some(2),
        device: "CPU".into(),
        eviction: None,
        kv_events: None,
        speculative: None,
    }
}

/// The core takes request ids from its caller; these tests number theirs from one counter.
trait Submit {
    fn add(&mut self, prompt: Vec<u32>, params: GenerationParams) -> Result<u64, EngineError>;
    fn encode_prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>, EngineError>;
}

impl Submit for Engine {
    fn add(&mut self, prompt: Vec<u32>, params: GenerationParams) -> Result<u64, EngineError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.add_request(id, prompt, params).map(|()| id)
    }
    fn encode_prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>, EngineError> {
        assert!(!chat, "these tests encode plain text");
        self.tokenizer().encode(text, true)
    }
}

fn engine() -> Engine {
    Engine::load(model_dir(), &config(64 << 20)).expect("load the tiny model")
}

fn greedy(n: usize) -> GenerationParams {
    GenerationParams {
        max_new_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Runs to the end; the finished outputs by (request, index).
fn run(e: &mut Engine) -> HashMap<(u64, usize), (FinishReason, Vec<u32>, String)> {
    let mut done = HashMap::new();
    e.run_to_completion(|ev| {
        if let Event::Finished {
            request,
            index,
            reason,
            token_ids,
            text,
        } = ev
        {
            done.insert(
                (*request, *index),
                (*reason, token_ids.clone(), text.clone()),
            );
        }
    })
    .unwrap();
    done
}

fn blocks_of(tokens: usize) -> usize {
    tokens.div_ceil(32)
}

#[test]
fn end_of_sequence_ends_one_output_early_and_frees_its_blocks_at_once() {
    let mut e = engine();
    let a = e
        .encode_prompt("the river and the garden of the city", false)
        .unwrap();
    let b = e.encode_prompt("Paris brings new light", false).unwrap();
    // The undisturbed greedy run of a, to pick a stop id it reaches at its 6th token.
    let ra = e.add(a.clone(), greedy(40)).unwrap();
    let full = run(&mut e).remove(&(ra, 0)).unwrap().1;
    let stop = full[5];
    let first = full.iter().position(|&t| t == stop).unwrap();

    let mut params = greedy(40);
    params.stop_token_ids = Some(vec![stop]);
    let ra = e.add(a.clone(), params).unwrap();
    let rb = e.add(b.clone(), greedy(40)).unwrap();
    let mut seen_end = false;
    while !e.is_idle() {
        for ev in e.step().unwrap() {
            if let Event::Finished {
                request,
                reason,
                token_ids,
                ..
            } = &ev
            {
                if *request == ra {
                    assert_eq!(*reason, FinishReason::Stop);
                    assert_eq!(token_ids[..], full[..=first], "ends with the stop id");
                    // Only b's blocks are still referenced, right after a ended.
                    let st = e.cache_stats();
                    assert_eq!(st.sequences, 1);
                    let b_len = b.len() + first; // b has as many tokens generated (one per step)
                    assert!(st.used_blocks <= blocks_of(b_len + 1), "{st:?}");
                    seen_end = true;
                }
            }
        }
    }
    assert!(seen_end);
    assert_eq!(e.cache_stats().used_blocks, 0);
    let _ = rb;
}

#[test]
fn stop_strings_cut_the_text_and_end_the_output() {
    let mut e = engine();
    let p = e.encode_prompt("quiet Tokyo river", false).unwrap();
    let r = e.add(p.clone(), greedy(48)).unwrap();
    let (_, ids, text) = run(&mut e).remove(&(r, 0)).unwrap();
    // A stop string from the middle of the text: three ASCII letters.
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let at = (4..chars.len().saturating_sub(3))
        .find(|&i| chars[i..i + 3].iter().all(|(_, c)| c.is_ascii_alphabetic()))
        .expect("three letters in a row in the greedy text");
    let stop: String = chars[at..at + 3].iter().map(|(_, c)| c).collect();
    let cut = text.find(&stop).unwrap();
    let mut params = greedy(48);
    params.stop = vec!["no such text \u{1F600}".into(), stop.clone()];
    let r = e.add(p, params).unwrap();
    let mut streamed = String::new();
    let mut done = None;
    e.run_to_completion(|ev| match ev {
        Event::Token { request, text, .. } if *request == r => streamed.push_str(text),
        Event::Finished {
            reason,
            token_ids,
            text,
            ..
        } => done = Some((*reason, token_ids.clone(), text.clone())),
        _ => {}
    })
    .unwrap();
    let (reason, got_ids, got_text) = done.unwrap();
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(
        got_text,
        text[..cut],
        "text ends before the stop string {stop:?}"
    );
    assert_eq!(
        streamed, got_text,
        "the streamed pieces never showed the stop string"
    );
    assert!(ids.starts_with(&got_ids) && got_ids.len() < ids.len());
    assert_eq!(e.cache_stats().used_blocks, 0);
}

#[test]
fn abort_mid_decode_frees_blocks_and_leaves_the_others_untouched() {
    let mut e = engine();
    let a = e
        .encode_prompt("over would of and may as is", false)
        .unwrap();
    let b = e.encode_prompt("the cache of the river", false).unwrap();
    let rb = e.add(b.clone(), greedy(30)).unwrap();
    let alone = run(&mut e).remove(&(rb, 0)).unwrap().1;

    let ra = e.add(a, greedy(200)).unwrap();
    let rb = e.add(b, greedy(30)).unwrap();
    for _ in 0..10 {
        e.step().unwrap();
    }
    let before = e.cache_stats();
    assert_eq!(before.sequences, 2);
    let ev = e.abort(ra).unwrap();
    assert!(
        matches!(ev.last(), Some(Event::Finished { request, reason: FinishReason::Abort, .. }) if *request == ra)
    );
    let after = e.cache_stats();
    assert_eq!(after.sequences, 1);
    assert!(
        after.used_blocks < before.used_blocks,
        "{before:?} -> {after:?}"
    );
    assert!(e.abort(ra).is_err(), "an aborted request is gone");
    let out = run(&mut e).remove(&(rb, 0)).unwrap().1;
    assert_eq!(
        out, alone,
        "the other request generates what it generates alone"
    );
    assert_eq!(e.cache_stats().used_blocks, 0);
}

#[test]
fn a_prompt_over_the_context_or_the_whole_cache_is_refused_alone() {
    // 4 blocks of KV cache in all (2 layers x (K + V) x 2 heads x 32 x 32 x 4 bytes per block).
    let mut e = Engine::load(model_dir(), &config(4 * 2 * 2 * 2 * 32 * 32 * 4)).unwrap();
    assert_eq!(e.num_blocks(), 4);
    let ok = e
        .add(e.encode_prompt("Paris", false).unwrap(), greedy(8))
        .unwrap();
    let ctx = e.context_len().expect("config.json gives the context");
    let long = vec![5u32; ctx];
    match e.add(long, greedy(8)) {
        Err(EngineError::Request(m)) => assert!(m.message.contains("context"), "{m}"),
        other => panic!("{other:?}"),
    }
    match e.add(vec![5u32; 200], greedy(8)) {
        Err(EngineError::Request(m)) => assert!(m.message.contains("blocks"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(e.add(vec![], greedy(8)).is_err());
    let done = run(&mut e);
    assert_eq!(done.len(), 1);
    assert_eq!(done[&(ok, 0)].1.len(), 8);
}

#[test]
fn preemption_and_forks_give_what_an_undisturbed_run_gives() {
    let prompts = [
        "the and or of a of",
        "river garden there the cache",
        "quiet Tokyo",
        "new city light over the river",
    ];
    let mut big = engine();
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| big.encode_prompt(p, false).unwrap())
        .collect();
    let reqs: Vec<u64> = ids
        .iter()
        .map(|p| big.add(p.clone(), greedy(60)).unwrap())
        .collect();
    let want = run(&mut big);
    assert_eq!(big.counters().preemptions, 0);

    // 6 blocks for 4 sequences that grow to 3 blocks each: preemption and recomputation.
    let mut small = Engine::load(model_dir(), &config(6 * 2 * 2 * 2 * 32 * 32 * 4)).unwrap();
    let sreqs: Vec<u64> = ids
        .iter()
        .map(|p| small.add(p.clone(), greedy(60)).unwrap())
        .collect();
    let got = run(&mut small);
    assert!(
        small.counters().preemptions > 0,
        "the small cache must preempt"
    );
    for (r, s) in reqs.iter().zip(&sreqs) {
        assert_eq!(got[&(*s, 0)].1, want[&(*r, 0)].1);
    }

    // n = 3 sampled outputs: forks of the first; same seed, same tokens.
    let sampled = |e: &mut Engine, seed| {
        let params = GenerationParams {
            max_new_tokens: 20,
            sampling: Sampling {
                temperature: 0.9,
                top_k: 30,
                top_p: 0.95,
            },
            seed: Some(seed),
            ignore_eos: true,
            n: 3,
            ..Default::default()
        };
        let r = e.add(ids[1].clone(), params).unwrap();
        let done = run(e);
        (0..3).map(|i| done[&(r, i)].1.clone()).collect::<Vec<_>>()
    };
    let forks = big.counters().forks;
    let x = sampled(&mut big, 7);
    assert_eq!(big.counters().forks, forks + 2);
    assert_eq!(x, sampled(&mut big, 7));
    assert_ne!(x, sampled(&mut big, 8));
    assert!(x.iter().all(|o| o.len() == 20));
    assert!(x[0] != x[1] || x[1] != x[2], "three samples all equal");
    assert_eq!(big.cache_stats().used_blocks, 0);
}

#[test]
fn cache_eviction_bounds_every_sequence_and_rotates_kept_keys() {
    use paged_attention::cache::EvictionPolicy;
    let prompts = [
        "the and or of a of the river garden there the cache over would of",
        "quiet Tokyo",
    ];
    let run_with = |eviction| {
        let mut cfg = config(64 << 20);
        cfg.eviction = eviction;
        let mut e = Engine::load(model_dir(), &cfg).unwrap();
        let reqs: Vec<u64> = prompts
            .iter()
            .map(|p| {
                let ids = e.encode_prompt(p, false).unwrap();
                e.add(ids, greedy(150)).unwrap()
            })
            .collect();
        let mut most = 0;
        while !e.is_idle() {
            e.step().unwrap();
            let st = e.cache_stats();
            most = most.max(st.used_blocks);
        }
        (e.counters(), most, reqs)
    };
    // A budget no sequence reaches: nothing is evicted.
    let (c, most_free, _) = run_with(Some(EvictionPolicy {
        start: 1,
        recent: 1,
        budget: 16,
    }));
    assert_eq!((c.evictions, c.rotated_blocks), (0, 0));
    // 3 blocks per sequence: both are cut back again and again, kept keys are re-rotated, and
    // the cache never holds more than 2 x (3 + the block being filled).
    let (c, most, _) = run_with(Some(EvictionPolicy {
        start: 1,
        recent: 1,
        budget: 3,
    }));
    assert!(c.evictions >= 4 && c.rotated_blocks > 0, "{c:?}");
    assert!(
        most <= 2 * 4 && most < most_free,
        "{most} blocks at most (without eviction {most_free})"
    );
}

fn speculative_engine(k: usize, draft_length: DraftLength) -> Engine {
    let mut cfg = config(64 << 20);
    cfg.speculative = Some(SpeculativeConfig {
        method: SpeculativeMethod::PromptLookup,
        draft_model: None,
        num_tokens: k,
        max_ngram: 3,
        // Fixed: ten sequences still draft (up to 3 each): the test is about exactness, not
        // speed.
        max_rows: 40,
        draft_length,
    });
    Engine::load(model_dir(), &cfg).expect("load the tiny model")
}

/// Ten prompts, some of them repeating themselves (so that lookups find drafts).
fn spec_prompts(e: &Engine) -> Vec<Vec<u32>> {
    let texts = [
        "the river and the garden of the city, the river and the garden of the city",
        "Paris brings new light",
        "quiet Tokyo river quiet Tokyo river quiet Tokyo",
        "the and or of a of the and or of a of",
        "river garden there the cache",
        "new city light over the river new city light over",
        "a a a a a a a a",
        "of the city of the city of the",
        "garden light Tokyo Paris",
        "cache the cache the cache the cache",
    ];
    texts
        .iter()
        .map(|t| e.encode_prompt(t, false).unwrap())
        .collect()
}

#[test]
fn speculation_keeps_greedy_ids_stops_and_the_block_managers_state() {
    for mode in [DraftLength::Fixed, DraftLength::Adaptive] {
        speculation_keeps_greedy_ids(mode);
    }
}

fn speculation_keeps_greedy_ids(mode: DraftLength) {
    let mut plain = engine();
    let mut spec = speculative_engine(4, mode);
    let prompts = spec_prompts(&plain);
    // Output 3 stops at an id its undisturbed run reaches mid-way: the stop applies to accepted
    // tokens as to sampled ones.
    let probe = plain.add(prompts[3].clone(), greedy(128)).unwrap();
    let full = run(&mut plain).remove(&(probe, 0)).unwrap().1;
    let stop = full[40];
    let params = |i: usize| {
        let mut p = greedy(128);
        if i == 3 {
            p.stop_token_ids = Some(vec![stop]);
        }
        p
    };
    let mut want = Vec::new();
    for e in [&mut plain, &mut spec] {
        want.push(run_prompts(e, &prompts, params));
    }
    for (i, (a, b)) in want[0].iter().zip(&want[1]).enumerate() {
        assert_eq!(
            a, b,
            "prompt {i}: speculation ({mode:?}) changed the output"
        );
    }
    assert_eq!(want[0][3].0, FinishReason::Stop);
    assert!(want[0][3].1.len() <= 41);
    let s = spec.stats();
    assert!(
        s.draft_tokens > 0
            && s.accepted_draft_tokens > 0
            && s.accepted_draft_tokens < s.draft_tokens,
        "drafts verified, some accepted, some rejected: {s:?}"
    );
    // The plain engine ran the probe first: compare with a plain engine that did not.
    let mut fresh = engine();
    for (i, p) in prompts.iter().enumerate() {
        fresh.add(p.clone(), params(i)).unwrap();
    }
    run(&mut fresh);
    assert!(
        s.steps < fresh.stats().steps,
        "accepted drafts save steps: {} against {}",
        s.steps,
        fresh.stats().steps
    );
    let (a, b) = (fresh.cache_stats(), spec.cache_stats());
    assert_eq!(b.used_blocks, 0, "leaked blocks: {b:?}");
    assert_eq!(
        a, b,
        "the prefix cache must hold what a run without speculation leaves, no rejected draft"
    );
    assert!(a.prefix_blocks > 0);
}

/// Runs `prompts` (prompt `i` with `params(i)`) to the end; the outputs, in prompt order.
fn run_prompts(
    e: &mut Engine,
    prompts: &[Vec<u32>],
    params: impl Fn(usize) -> GenerationParams,
) -> Vec<(FinishReason, Vec<u32>, String)> {
    let ids: Vec<u64> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| e.add(p.clone(), params(i)).unwrap())
        .collect();
    let mut done = run(e);
    ids.iter().map(|r| done.remove(&(*r, 0)).unwrap()).collect()
}

/// The generated ids of [`run_prompts`].
fn run_ids(
    e: &mut Engine,
    prompts: &[Vec<u32>],
    params: impl Fn(usize) -> GenerationParams,
) -> Vec<Vec<u32>> {
    run_prompts(e, prompts, params)
        .into_iter()
        .map(|o| o.1)
        .collect()
}

/// Sampling of `n` tokens with top-k and top-p, seeded `seed`.
fn sampled(n: usize, seed: u64) -> GenerationParams {
    GenerationParams {
        max_new_tokens: n,
        sampling: Sampling {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.95,
        },
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn a_seeded_sampled_run_with_speculation_repeats() {
    // Adaptive drafts with 4 sequences (with 10, a row costs more than an unmeasured draft is
    // expected to give, and only probes draft).
    let run_once = |mode: DraftLength| {
        let mut e = speculative_engine(4, mode);
        let mut prompts = spec_prompts(&e);
        if mode == DraftLength::Adaptive {
            prompts.truncate(4);
        }
        let out = run_ids(&mut e, &prompts, |i| sampled(64, 100 + i as u64));
        let s = e.stats();
        assert!(s.accepted_draft_tokens > 0, "{mode:?}: {s:?}");
        assert_eq!(e.cache_stats().used_blocks, 0);
        out
    };
    for mode in [DraftLength::Fixed, DraftLength::Adaptive] {
        let a = run_once(mode);
        assert!(a.iter().all(|o| o.len() == 64));
        assert_eq!(a, run_once(mode), "{mode:?}");
    }
}

fn draft_engine(draft: &Path, k: usize) -> Result<Engine, EngineError> {
    draft_engine_with(draft, k, DraftLength::Fixed)
}

fn draft_engine_with(
    draft: &Path,
    k: usize,
    draft_length: DraftLength,
) -> Result<Engine, EngineError> {
    let mut cfg = config(64 << 20);
    cfg.speculative = Some(SpeculativeConfig {
        method: SpeculativeMethod::Draft,
        draft_model: Some(draft.to_path_buf()),
        num_tokens: k,
        max_ngram: 3,
        max_rows: 40,
        draft_length,
    });
    Engine::load(model_dir(), &cfg)
}

#[test]
fn a_draft_model_keeps_greedy_ids_and_both_block_managers_state() {
    let run_all =
        |e: &mut Engine, prompts: &[Vec<u32>]| run_ids(e, prompts, |i| greedy(64 + 8 * i));
    let mut plain = engine();
    let prompts = spec_prompts(&plain);
    let want = run_all(&mut plain, &prompts);
    // The target as its own draft agrees nearly always; gqa1 (other weights) nearly never.
    let gqa1 = model_dir().parent().unwrap().join("gqa1");
    for (draft, rate) in [(model_dir(), 0.9..=1.0), (gqa1.as_path(), 0.0..=0.2)] {
        let mut spec = draft_engine(draft, 3).unwrap();
        let got = run_all(&mut spec, &prompts);
        assert_eq!(got, want, "draft {}: greedy ids changed", draft.display());
        let s = spec.stats();
        let accepted = s.accepted_draft_tokens as f64 / s.draft_tokens.max(1) as f64;
        assert!(
            s.draft_tokens > 0 && rate.contains(&accepted),
            "draft {}: {} of {} drafts accepted, expected a rate in {rate:?}",
            draft.display(),
            s.accepted_draft_tokens,
            s.draft_tokens
        );
        assert!(s.draft_infer_time > std::time::Duration::ZERO);
        assert_eq!(
            spec.cache_stats(),
            plain.cache_stats(),
            "the target's block manager must end as without speculation"
        );
        let d = spec.draft_cache_stats().unwrap();
        assert_eq!(
            (d.used_blocks, d.sequences),
            (0, 0),
            "the draft cache leaked: {d:?}"
        );
        // Drafts sized by their acceptance and cost: the same ids. Either draft costs about
        // what the target does (a call reads as many weights), so a draft never pays, even one
        // always accepted; the drafts back off to a few (the first steps', then a probe per
        // 32 turned down), far fewer than the fixed drafts.
        let mut adaptive = draft_engine_with(draft, 3, DraftLength::Adaptive).unwrap();
        assert_eq!(
            run_all(&mut adaptive, &prompts),
            want,
            "adaptive drafts changed ids"
        );
        let a = adaptive.stats();
        assert!(
            a.draft_tokens > 0 && a.draft_tokens * 4 < s.draft_tokens,
            "draft {}: {} adaptive drafts against {} fixed",
            draft.display(),
            a.draft_tokens,
            s.draft_tokens
        );
        assert_eq!(adaptive.cache_stats(), plain.cache_stats());
        let d = adaptive.draft_cache_stats().unwrap();
        assert_eq!((d.used_blocks, d.sequences), (0, 0), "{d:?}");
    }
}

#[test]
fn a_draft_model_run_repeats_with_a_seed_and_a_foreign_vocabulary_is_refused() {
    let run_once = || {
        let mut e = draft_engine(model_dir(), 4).unwrap();
        let prompts = spec_prompts(&e);
        let out = run_ids(&mut e, &prompts, |i| sampled(48, 7 + i as u64));
        assert!(e.stats().accepted_draft_tokens > 0, "{:?}", e.stats());
        out
    };
    let a = run_once();
    assert!(a.iter().all(|o| o.len() == 48));
    assert_eq!(a, run_once());

    // Copies of the model whose vocabulary differs: a size in config.json, or two token ids
    // swapped in tokenizer.json.
    let src = model_dir();
    let copy = |name: &str, edit: &dyn Fn(&mut serde_json::Value, &mut serde_json::Value)| {
        let dir = src.parent().unwrap().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(src).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
        };
        let (mut cfg, mut tok) = (read("config.json"), read("tokenizer.json"));
        edit(&mut cfg, &mut tok);
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        dir
    };
    let bigger = copy("vocab513", &|cfg, _| cfg["vocab_size"] = 513.into());
    let swapped = copy("swapped", &|_, tok| {
        let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = (vocab["e"].clone(), vocab["t"].clone());
        vocab.insert("e".into(), b);
        vocab.insert("t".into(), a);
    });
    for (dir, why) in [(bigger, "513 tokens"), (swapped, "tokenizer differs")] {
        let err = draft_engine(&dir, 4)
            .err()
            .expect("a foreign draft is refused");
        assert!(err.to_string().contains(why), "{err}");
    }
}

#[test]
fn a_failed_run_fails_its_requests_alone_and_caches_nothing_of_it() {
    let mut e = engine();
    // 64-token prompts: one fills a step's token budget (64), so the other waits.
    let text = spec_prompts(&e).concat();
    let a: Vec<u32> = text.iter().copied().cycle().take(64).collect();
    let b: Vec<u32> = text.iter().rev().copied().cycle().take(64).collect();
    // What b, then a, give on an engine whose runs never fail.
    let mut fresh = engine();
    let rb = fresh.add(b.clone(), greedy(40)).unwrap();
    let b_alone = run(&mut fresh).remove(&(rb, 0)).unwrap().1;
    let ra = fresh.add(a.clone(), greedy(40)).unwrap();
    let a_alone = run(&mut fresh).remove(&(ra, 0)).unwrap().1;

    // The run of a's prompt fails: a fails, b (waiting) goes on.
    let ra = e.add(a.clone(), greedy(40)).unwrap();
    let rb = e.add(b, greedy(40)).unwrap();
    e.fail_next_run();
    match e.step() {
        Err(EngineError::StepFailed { requests, .. }) => assert_eq!(requests, vec![ra]),
        other => panic!("the step must fail request {ra} alone: {other:?}"),
    }
    assert!(e.abort(ra).is_err(), "the failed request is gone");
    assert_eq!((e.num_waiting(), e.num_running()), (1, 0));
    let done = run(&mut e);
    assert!(!done.contains_key(&(ra, 0)));
    assert_eq!(done[&(rb, 0)].1, b_alone, "the other request is untouched");

    // Mid-decode, with n = 2: the request's two outputs end, their blocks return.
    let n2 = GenerationParams { n: 2, ..greedy(40) };
    let rc = e.add(a.clone(), n2).unwrap();
    let mut tokens = 0;
    while tokens < 4 {
        let ev = e.step().unwrap();
        tokens += ev
            .iter()
            .filter(|v| matches!(v, Event::Token { .. }))
            .count();
    }
    assert_eq!(e.num_running(), 2, "both outputs decode");
    e.fail_next_run();
    match e.step() {
        Err(EngineError::StepFailed { requests, .. }) => assert_eq!(requests, vec![rc]),
        other => panic!("the step must fail request {rc}: {other:?}"),
    }
    assert!(e.is_idle());
    assert_eq!(e.cache_stats().used_blocks, 0);

    // The engine serves the next request as if nothing had failed, and its prefix cache holds
    // what the undisturbed engine's does: nothing the failed runs were to write.
    let ra = e.add(a, greedy(40)).unwrap();
    assert_eq!(run(&mut e)[&(ra, 0)].1, a_alone);
    assert_eq!(e.cache_stats(), fresh.cache_stats());
}
