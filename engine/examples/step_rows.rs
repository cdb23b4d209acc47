//! Decode step time against the rows a step verifies (speculative decoding's back-off rule
//! rests on this curve).
//!
//! ```text
//! LD_LIBRARY_PATH=<openvino libs> cargo run --release -p paged_attention_engine \
//!     --example step_rows -- MODEL_DIR PROMPTS.json [ROUNDS] [NEW_TOKENS] [B:k,B:k,...]
//! ```
//!
//! PROMPTS.json is an array of token-id arrays. Each configuration `B:k` runs the first `B`
//! prompts at once, greedy, `NEW_TOKENS` each, with prompt-lookup drafts of up to `k` tokens
//! (no speculation at k = 0) and no row limit; f32 cache and precision, 2 threads, every
//! prompt prefilled in the first step, after a warm-up round. The configurations alternate (rotated each round) so
//! other load on the machine falls on all of them. Every later step is a decode step of
//! `emitting sequences + drafts` rows; its wall time is binned by that row count. Prints per
//! configuration its acceptance (accepted / drafted, tokens a sequence gains a step), and per row
//! count the median step time, its range and ms per row.

use std::collections::BTreeMap;
use std::time::Instant;

use paged_attention_engine::{
    DraftLength, EngineConfig, EngineCore, GenerationParams, KvCacheSize, Precision,
    SpeculativeConfig, SpeculativeMethod,
};

type Error = Box<dyn std::error::Error>;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn engine(dir: &str, k: usize, prompt_rows: usize) -> Result<EngineCore, Error> {
    let cfg = EngineConfig {
        cache_type: paged_attention::dtype::ElemType::F32,
        kv_cache: KvCacheSize::Bytes(2_000_000_000),
        max_batched_tokens: prompt_rows,
        precision: Some(Precision::F32),
        threads: Some(2),
        speculative: (k > 0).then_some(SpeculativeConfig {
            method: SpeculativeMethod::PromptLookup,
            draft_model: None,
            num_tokens: k,
            max_ngram: 3,
            max_rows: usize::MAX,
            draft_length: DraftLength::Fixed,
        }),
        ..EngineConfig::default()
    };
    Ok(EngineCore::load(dir, &cfg)?)
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: step_rows MODEL_DIR PROMPTS.json [ROUNDS] [NEW] [B:k,...]".into());
    }
    let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(&args[2])?)?;
    let rounds: usize = args.get(3).map_or(Ok(3), |s| s.parse())?;
    let new: usize = args.get(4).map_or(Ok(32), |s| s.parse())?;
    let configs: Vec<(usize, usize)> = args
        .get(5)
        .map_or("1:0,2:0,4:0,8:0,1:3,4:2,8:1,8:2,8:3,8:5", String::as_str)
        .split(',')
        .map(|c| {
            let (b, k) = c.split_once(':').ok_or("a configuration is B:k")?;
            Ok::<_, Error>((b.parse()?, k.parse()?))
        })
        .collect::<Result<_, _>>()?;
    if configs.iter().any(|&(b, _)| b == 0 || b > prompts.len()) {
        return Err(format!("B must be 1 to {} (the prompts)", prompts.len()).into());
    }
    let prompt_rows: usize = prompts.iter().map(Vec::len).sum::<usize>().max(1);
    let mut engines: BTreeMap<usize, EngineCore> = BTreeMap::new();
    for &(_, k) in &configs {
        if let std::collections::btree_map::Entry::Vacant(v) = engines.entry(k) {
            v.insert(engine(&args[1], k, prompt_rows)?);
        }
    }
    // rows -> step times (ms); config -> (drafted, accepted, seq-steps, tokens gained, rows),
    // and its step times (ms)
    let mut by_rows: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut by_config: BTreeMap<(usize, usize), [u64; 5]> = BTreeMap::new();
    let mut config_ms: BTreeMap<(usize, usize), Vec<f64>> = BTreeMap::new();
    let mut next_id = 0u64;
    // Round 0 warms up (OpenVINO's first inferences of each shape, the prefix cache): not counted.
    for round in 0..=rounds {
        for c in 0..configs.len() {
            let (b, k) = configs[(c + round) % configs.len()];
            let e = engines.get_mut(&k).ok_or("engine")?;
            for p in &prompts[..b] {
                let params = GenerationParams {
                    max_new_tokens: new,
                    ignore_eos: true,
                    ..GenerationParams::default()
                };
                e.add_request(next_id, p.clone(), params)?;
                next_id += 1;
            }
            let mut first = true;
            while !e.is_idle() {
                let before = e.stats();
                let t = Instant::now();
                e.step()?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let after = e.stats();
                if first || round == 0 {
                    // Every prompt is prefilled in this step.
                    if first && e.num_waiting() > 0 {
                        return Err("a prompt did not fit the first step".into());
                    }
                    first = false;
                    continue;
                }
                let drafted = after.draft_tokens - before.draft_tokens;
                let accepted = after.accepted_draft_tokens - before.accepted_draft_tokens;
                let gained = after.generated_tokens - before.generated_tokens;
                let emitting = gained - accepted;
                by_rows
                    .entry((emitting + drafted) as usize)
                    .or_default()
                    .push(ms);
                let a = by_config.entry((b, k)).or_default();
                a[0] += drafted;
                a[1] += accepted;
                a[2] += emitting;
                a[3] += gained;
                a[4] += emitting + drafted;
                config_ms.entry((b, k)).or_default().push(ms);
            }
        }
    }
    println!(
        "| B | k | steps | rows a step | median step ms | drafted | acceptance | \
         tokens a sequence gains a step | tokens per row | decode tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for ((b, k), [d, a, s, g, r]) in &by_config {
        let ms = config_ms.get_mut(&(*b, *k)).ok_or("steps")?;
        let total: f64 = ms.iter().sum();
        println!(
            "| {b} | {k} | {} | {:.1} | {:.1} | {d} | {:.1}% | {:.2} | {:.2} | {:.1} |",
            ms.len(),
            *r as f64 / ms.len() as f64,
            median(ms),
            100.0 * *a as f64 / (*d).max(1) as f64,
            *g as f64 / (*s).max(1) as f64,
            *g as f64 / (*r).max(1) as f64,
            *g as f64 / total * 1e3
        );
    }
    println!();
    println!("| rows | steps | median step ms | min-max | ms per row |");
    println!("|---|---|---|---|---|");
    for (rows, v) in &mut by_rows {
        let m = median(v);
        println!(
            "| {rows} | {} | {m:.1} | {:.1}-{:.1} | {:.2} |",
            v.len(),
            v[0],
            v[v.len() - 1],
            m / *rows as f64
        );
    }
    Ok(())
}
