//! Randomized operation sequences on the block manager and the scheduler (own seeded PRNG):
//! after every operation no block leaks or is freed twice (free + cached + distinct referenced
//! = total) and every ref count equals the number of block tables holding the block.

use paged_attention::cache::{
    BlockManager, EvictionPolicy, ManagerConfig, Request, Scheduler, SchedulerConfig, SplitMix64,
};
use paged_attention::PaError;

fn check(m: &BlockManager, seed: u64, i: usize, op: &str) {
    if let Err(e) = m.check_invariants() {
        panic!("seed {seed}, op {i} ({op}): {e}");
    }
}

#[test]
fn random_manager_operations_never_leak_or_double_free_blocks() {
    for seed in 0..60u64 {
        let mut rng = SplitMix64::new(seed);
        let bs = rng.range(1, 5);
        let mut m = BlockManager::new(ManagerConfig {
            num_blocks: rng.range(4, 24),
            block_size: bs,
            prefix_caching: rng.range(0, 3) > 0,
        })
        .unwrap();
        let mut live: Vec<u64> = Vec::new();
        let mut next_id = 0u64;
        // A small token alphabet and shared prompt stems make prefix hits frequent.
        let stem: Vec<u32> = (0..12).map(|_| rng.range(0, 3) as u32).collect();
        for i in 0..400 {
            let pick = |rng: &mut SplitMix64, live: &[u64]| live[rng.range(0, live.len() - 1)];
            let op = rng.range(0, 9);
            let name;
            let r: Result<(), PaError> = match op {
                0 | 1 => {
                    name = "add";
                    let n = rng.range(1, 12);
                    let prompt = stem[..n].to_vec();
                    let id = next_id;
                    next_id += 1;
                    let cached = m.add_sequence(id, &prompt).unwrap();
                    assert!(cached < prompt.len() && cached.is_multiple_of(bs));
                    live.push(id);
                    m.append(id, &prompt[cached..]).map(|_| ())
                }
                2 | 3 if !live.is_empty() => {
                    name = "append";
                    let id = pick(&mut rng, &live);
                    let toks: Vec<u32> = (0..rng.range(1, 6))
                        .map(|_| rng.range(0, 3) as u32)
                        .collect();
                    let before = m.len(id).unwrap();
                    let r = m.append(id, &toks).map(|_| ());
                    if r.is_err() {
                        assert_eq!(
                            m.len(id).unwrap(),
                            before,
                            "failed append changed the length"
                        );
                    }
                    r
                }
                4 if !live.is_empty() => {
                    name = "fork";
                    let id = pick(&mut rng, &live);
                    let child = next_id;
                    next_id += 1;
                    live.push(child);
                    m.fork(id, child)
                }
                5 if !live.is_empty() => {
                    name = "free";
                    let k = rng.range(0, live.len() - 1);
                    m.free(live.swap_remove(k))
                }
                6 if !live.is_empty() => {
                    name = "truncate";
                    let id = pick(&mut rng, &live);
                    let len = m.len(id).unwrap();
                    m.truncate(id, rng.range(0, len))
                }
                7 if !live.is_empty() => {
                    name = "evict";
                    let id = pick(&mut rng, &live);
                    let len = m.len(id).unwrap();
                    let scores: Vec<f32> = (0..len).map(|_| rng.next_f64() as f32).collect();
                    m.accumulate_scores(id, &scores).unwrap();
                    let p = EvictionPolicy {
                        start: rng.range(0, 1),
                        recent: 1,
                        budget: rng.range(2, 4),
                    };
                    m.evict(id, p).map(|_| ())
                }
                8 => {
                    name = "mark_computed/take_rotation";
                    m.mark_computed();
                    if let Some(r) = m.take_rotation() {
                        assert_eq!(r.deltas.len(), r.len() * bs);
                    }
                    Ok(())
                }
                _ => {
                    name = "noop";
                    Ok(())
                }
            };
            match r {
                Ok(()) | Err(PaError::OutOfBlocks { .. }) => {}
                Err(e) => panic!("seed {seed}, op {i} ({name}): unexpected error {e}"),
            }
            check(&m, seed, i, name);
        }
        for id in live {
            m.free(id).unwrap();
        }
        check(&m, seed, usize::MAX, "final free");
        let s = m.stats();
        assert_eq!(
            s.used_blocks, 0,
            "seed {seed}: blocks still used after freeing all"
        );
        assert_eq!(s.free_blocks + s.cached_blocks, s.total_blocks);
    }
}

#[test]
fn random_scheduler_workloads_finish_and_return_every_block() {
    for seed in 0..20u64 {
        let mut rng = SplitMix64::new(1000 + seed);
        let num_blocks = rng.range(8, 40);
        let eviction = (seed % 3 == 0).then_some(EvictionPolicy {
            start: 1,
            recent: 2,
            budget: 4,
        });
        let mut s = Scheduler::new(SchedulerConfig {
            num_blocks,
            block_size: 4,
            prefix_caching: seed % 2 == 0,
            max_batched_tokens: rng.range(4, 32),
            max_seqs: rng.range(1, 6),
            eviction,
        })
        .unwrap();
        let mut added = 0;
        for step in 0..3000 {
            if added < 25 && rng.range(0, 2) == 0 {
                let plen = rng.range(1, 20);
                let r = Request {
                    id: added,
                    prompt: (0..plen).map(|_| rng.range(0, 2) as u32).collect(),
                    max_new_tokens: rng.range(1, 10),
                    priority: rng.range(0, 3) as i32,
                };
                match s.add_request(r) {
                    Ok(()) | Err(PaError::OutOfBlocks { .. }) => {}
                    Err(e) => panic!("seed {seed}: {e}"),
                }
                added += 1;
            }
            if added == 25 && s.is_idle() {
                break;
            }
            let st = s.schedule().unwrap();
            assert!(st.num_tokens() <= s.config().max_batched_tokens);
            assert_eq!(
                st.subsequence_begins.last().copied().unwrap_or(0) as usize,
                st.num_tokens()
            );
            let scores: Vec<f32> = (0..st.scores_len())
                .map(|_| rng.next_f64() as f32)
                .collect();
            s.accumulate_scores(&st, &scores).unwrap();
            let sampled: Vec<_> = st
                .seqs
                .iter()
                .filter(|q| q.emits)
                .map(|q| (q.id, 1))
                .collect();
            s.complete_step(&sampled).unwrap();
            if let Err(e) = s.manager().check_invariants() {
                panic!("seed {seed}, step {step}: {e}");
            }
        }
        assert!(s.is_idle(), "seed {seed}: workload did not finish");
        let st = s.manager().stats();
        assert_eq!(st.used_blocks, 0);
        assert_eq!(st.free_blocks + st.cached_blocks, num_blocks);
    }
}
