//! Score-based block eviction and the op's rotation inputs.
//!
//! The op's `scores` output is summed per block ([`BlockManager::accumulate_scores`]). When a
//! sequence holds more blocks than its budget, [`BlockManager::evict`] keeps the first `start`
//! blocks (attention sinks) and the `recent` most recent ones, and drops the lowest-scored
//! blocks in between. Every kept block after the first evicted one moves down by
//! `BS * (evicted blocks before it)` positions, so its keys (RoPE'd at the old positions) must
//! be rotated back by that many positions: the manager records that per physical block and
//! [`BlockManager::take_rotation`] hands the next op call its `rotated_block_indices` and
//! `rotation_deltas`. The deltas are rows of a LUT built by [`rotation_lut`] with
//! [`RotationDirection::Backward`]: row `m` rotates by `-m` positions.

use super::manager::{BlockCopy, BlockManager, SeqId};
use super::pool::BlockId;
use crate::error::{PaError, Result};

/// Which blocks of a sequence eviction must keep, and how many it may hold (all in blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionPolicy {
    /// Leading blocks always kept.
    pub start: usize,
    /// Most recent blocks always kept (at least 1: the block being written).
    pub recent: usize,
    /// Blocks the sequence may hold after eviction (`>= start + recent`).
    pub budget: usize,
}

/// What [`BlockManager::evict`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Logical block indices (before eviction) that were dropped, ascending.
    pub evicted: Vec<usize>,
    /// Copies to perform before the next op call (shared blocks that had to move are copied
    /// first, so the other holders keep their positions).
    pub copies: Vec<BlockCopy>,
}

/// The op's rotation inputs (12 and 13) for its next call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RotationInputs {
    /// `rotated_block_indices`, `[R]`.
    pub block_indices: Vec<i32>,
    /// `rotation_deltas`, `[R, BS]` row-major: LUT rows (positions to rotate back by).
    pub deltas: Vec<i32>,
    pub block_size: usize,
    /// Largest delta; the LUT needs at least `max_delta + 1` rows.
    pub max_delta: usize,
}

impl RotationInputs {
    /// `R`.
    pub fn len(&self) -> usize {
        self.block_indices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.block_indices.is_empty()
    }
    /// Rows the trig LUT must have.
    pub fn lut_rows(&self) -> usize {
        self.max_delta + 1
    }
}

/// Sign of the rotation a LUT row holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotationDirection {
    /// Row `m` = `[cos(m*f_i).., sin(m*f_i)..]`: rotates a key forward by `m` positions.
    Forward,
    /// Row `m` = `[cos(m*f_i).., -sin(m*f_i)..]`: rotates a key back by `m` positions (what
    /// eviction needs, since kept tokens only move to lower positions).
    Backward,
}

/// The op's `rotation_trig_lut`, `[rows, head_size]` row-major: row `m` holds `cos(m*f_i)` for
/// `i` in `0..D/2`, then `±sin(m*f_i)`, with `f_i = base^(-2i/D)` (RoPE with the rotate-half
/// layout the op uses: `x` = first half, `y` = second half of the head). Computed in f64.
pub fn rotation_lut(
    rows: usize,
    head_size: usize,
    base: f64,
    dir: RotationDirection,
) -> Result<Vec<f32>> {
    let len = rotation_lut_len(rows, head_size, base)?;
    let mut lut = crate::alloc::try_vec(len, 0f32, "the rotation LUT")?;
    fill_rotation_lut(&mut lut, head_size, base, dir);
    Ok(lut)
}

/// Elements of a `[rows, head_size]` LUT, after checking the parameters (even head size > 0,
/// finite base > 0) and that the size is representable.
pub fn rotation_lut_len(rows: usize, head_size: usize, base: f64) -> Result<usize> {
    if head_size == 0
        || !head_size.is_multiple_of(2)
        || base.is_nan()
        || base <= 0.0
        || !base.is_finite()
    {
        return Err(PaError::InvalidArgument {
            detail: format!(
                "rotation LUT needs an even head size > 0 and a finite base > 0, got head size \
                 {head_size}, base {base}"
            ),
        });
    }
    rows.checked_mul(head_size)
        .filter(|&n| n <= isize::MAX as usize / std::mem::size_of::<f32>())
        .ok_or_else(|| PaError::InvalidArgument {
            detail: format!(
                "rotation LUT of {rows} rows * head size {head_size} overflows the address space"
            ),
        })
}

/// Writes [`rotation_lut`] into `lut` (`rows * head_size` elements, parameters checked by
/// [`rotation_lut_len`]): the C ABI fills the caller's buffer without a copy.
pub fn fill_rotation_lut(lut: &mut [f32], head_size: usize, base: f64, dir: RotationDirection) {
    let half = head_size / 2;
    let sign = match dir {
        RotationDirection::Forward => 1.0,
        RotationDirection::Backward => -1.0,
    };
    for (m, row) in lut.chunks_exact_mut(head_size).enumerate() {
        for i in 0..half {
            let f = base.powf(-2.0 * i as f64 / head_size as f64);
            let a = m as f64 * f;
            row[i] = a.cos() as f32;
            row[half + i] = (sign * a.sin()) as f32;
        }
    }
}

impl BlockManager {
    /// Evicts the lowest-scored middle blocks of the sequence until it holds `policy.budget`
    /// blocks (ties: the older block goes first). Nothing happens when it is within budget.
    /// Evicted tokens are gone: the sequence's length drops by `BS` per block. Kept blocks that
    /// move get a pending rotation (see [`take_rotation`](Self::take_rotation)); a moving block
    /// shared with another sequence is copied first. Moved blocks leave the prefix cache and
    /// the sequence stops registering new ones (its positions no longer follow its prompt).
    pub fn evict(&mut self, id: SeqId, policy: EvictionPolicy) -> Result<Eviction> {
        let bs = self.cfg.block_size;
        if policy.recent == 0 || policy.start + policy.recent > policy.budget {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "eviction policy needs recent >= 1 and start + recent <= budget, got start \
                     {}, recent {}, budget {}",
                    policy.start, policy.recent, policy.budget
                ),
            });
        }
        let s = self.seq(id)?;
        let nb = s.blocks.len();
        if nb <= policy.budget {
            return Ok(Eviction::default());
        }
        let mut middle: Vec<usize> = (policy.start..nb - policy.recent).collect();
        middle.sort_by(|&a, &b| s.scores[a].total_cmp(&s.scores[b]).then(a.cmp(&b)));
        let mut evicted: Vec<usize> = middle[..nb - policy.budget].to_vec();
        evicted.sort_unstable();
        let mut is_evicted = vec![false; nb];
        evicted.iter().for_each(|&i| is_evicted[i] = true);

        // (old index, shift in blocks) of kept blocks that move.
        let mut moved = Vec::new();
        let mut shift = 0;
        for (i, &gone) in is_evicted.iter().enumerate() {
            if gone {
                shift += 1;
            } else if shift > 0 {
                moved.push((i, shift));
            }
        }
        let cow = moved
            .iter()
            .filter(|&&(i, _)| self.pool.ref_count(s.blocks[i]) > 1)
            .count();
        let freed = evicted
            .iter()
            .filter(|&&i| self.pool.ref_count(s.blocks[i]) == 1)
            .count();
        if cow > self.pool.available() + freed {
            return Err(PaError::OutOfBlocks {
                detail: format!(
                    "evicting from sequence {id} must copy {cow} shared blocks, {} available",
                    self.pool.available() + freed
                ),
            });
        }

        let old = s.clone();
        for &i in evicted.iter().rev() {
            self.release_block(old.blocks[i])?;
        }
        let mut blocks = old.blocks.clone();
        let mut copies = Vec::new();
        for &(i, sh) in &moved {
            let mut b = blocks[i];
            if self.pool.ref_count(b) > 1 {
                let dst = self.alloc()?;
                self.release_block(b)?;
                if let Some(&d) = self.pending_rotation.get(&b) {
                    self.pending_rotation.insert(dst, d);
                }
                copies.push(BlockCopy { src: b, dst });
                b = dst;
                blocks[i] = b;
            }
            self.pool.unregister(b);
            *self.pending_rotation.entry(b).or_insert(0) += (sh * bs) as u32;
        }

        let first_evicted = evicted[0];
        let s = self.seq_mut(id)?;
        s.blocks = keep(&blocks, &is_evicted);
        s.scores = keep(&old.scores, &is_evicted);
        s.tokens = old
            .tokens
            .chunks(bs)
            .enumerate()
            .filter(|(i, _)| !is_evicted[*i])
            .flat_map(|(_, c)| c.iter().copied())
            .collect();
        s.len -= evicted.len() * bs;
        s.hashes.truncate(first_evicted);
        s.hashable = false;
        Ok(Eviction { evicted, copies })
    }

    /// Rotations the next op call must apply (blocks, positions to rotate back by).
    pub fn pending_rotations(&self) -> Vec<(BlockId, u32)> {
        self.pending_rotation
            .iter()
            .map(|(&b, &d)| (b, d))
            .collect()
    }

    /// Hands out (and clears) the pending rotations as the op's inputs 12 and 13, blocks
    /// ascending, deltas `[R, BS]` (equal within a row: a block moves as a whole). `None` when
    /// nothing is pending. Pass them to the very next op call, with a LUT of at least
    /// [`RotationInputs::lut_rows`] rows built with [`RotationDirection::Backward`].
    pub fn take_rotation(&mut self) -> Option<RotationInputs> {
        if self.pending_rotation.is_empty() {
            return None;
        }
        let bs = self.cfg.block_size;
        let pending = std::mem::take(&mut self.pending_rotation);
        let mut r = RotationInputs {
            block_size: bs,
            ..Default::default()
        };
        for (b, d) in pending {
            r.block_indices.push(b as i32);
            r.deltas.extend(std::iter::repeat_n(d as i32, bs));
            r.max_delta = r.max_delta.max(d as usize);
        }
        Some(r)
    }
}

/// The elements of `v` whose index is not marked in `gone`.
fn keep<T: Copy>(v: &[T], gone: &[bool]) -> Vec<T> {
    v.iter()
        .zip(gone)
        .filter(|(_, &g)| !g)
        .map(|(&x, _)| x)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::manager::ManagerConfig;

    fn seq_with_scores(bs: usize, scores: &[f32]) -> BlockManager {
        let mut m = BlockManager::new(ManagerConfig {
            num_blocks: 16,
            block_size: bs,
            prefix_caching: true,
        })
        .unwrap();
        m.add_sequence(1, &[]).unwrap();
        let toks: Vec<u32> = (0..scores.len() as u32).collect();
        m.append(1, &toks).unwrap();
        m.accumulate_scores(1, scores).unwrap();
        m
    }

    #[test]
    fn eviction_keeps_start_and_recent_blocks_and_drops_the_lowest_scored() {
        // 7 blocks of 2; block scores 9, 1, 5, 0.5, 7, 0, 3 (blocks 5 and 6 are recent).
        let s = [9., 0., 1., 0., 5., 0., 0.5, 0., 7., 0., 0., 0., 3., 0.];
        let mut m = seq_with_scores(2, &s);
        let table = m.block_table(1).unwrap().to_vec();
        let p = EvictionPolicy {
            start: 1,
            recent: 2,
            budget: 5,
        };
        let ev = m.evict(1, p).unwrap();
        assert_eq!(ev.evicted, vec![1, 3], "blocks 1 (score 1) and 3 (0.5) go");
        let want: Vec<_> = [0, 2, 4, 5, 6].iter().map(|&i| table[i]).collect();
        assert_eq!(m.block_table(1).unwrap(), &want[..]);
        assert_eq!(m.len(1).unwrap(), 10);
        assert_eq!(m.block_scores(1).unwrap(), &[9.0, 5.0, 7.0, 0.0, 3.0]);
        // Block 5 (score 0) was recent, so it stayed although it is the lowest.
        m.check_invariants().unwrap();
        assert_eq!(
            m.evict(1, p).unwrap(),
            Eviction::default(),
            "within budget now"
        );
    }

    #[test]
    fn eviction_rotates_moved_blocks_back_by_the_positions_they_moved() {
        let s = [9., 0., 1., 0., 5., 0., 0.5, 0., 7., 0., 0., 0., 3., 0.];
        let mut m = seq_with_scores(2, &s);
        let table = m.block_table(1).unwrap().to_vec();
        m.evict(
            1,
            EvictionPolicy {
                start: 1,
                recent: 2,
                budget: 5,
            },
        )
        .unwrap();
        let r = m.take_rotation().unwrap();
        // Block 2 moves down 1 block (2 positions), blocks 4, 5, 6 move down 2 blocks (4).
        let mut want: Vec<(i32, i32)> = vec![
            (table[2] as i32, 2),
            (table[4] as i32, 4),
            (table[5] as i32, 4),
            (table[6] as i32, 4),
        ];
        want.sort_unstable();
        let got: Vec<(i32, i32)> = r
            .block_indices
            .iter()
            .enumerate()
            .map(|(i, &b)| (b, r.deltas[i * 2]))
            .collect();
        assert_eq!(got, want);
        assert!(r.deltas.chunks(2).all(|row| row[0] == row[1]));
        assert_eq!(r.lut_rows(), 5);
        assert!(m.take_rotation().is_none(), "rotations are handed out once");
    }

    #[test]
    fn evicting_a_shared_moved_block_copies_it_for_this_sequence_only() {
        let s = [1., 1., 0., 0., 1., 1., 1., 1.];
        let mut m = seq_with_scores(2, &s);
        m.fork(1, 2).unwrap();
        let table = m.block_table(2).unwrap().to_vec();
        let ev = m
            .evict(
                1,
                EvictionPolicy {
                    start: 1,
                    recent: 1,
                    budget: 3,
                },
            )
            .unwrap();
        assert_eq!(ev.evicted, vec![1]);
        assert_eq!(ev.copies.len(), 2, "blocks 2 and 3 move and are shared");
        assert_eq!(
            m.block_table(2).unwrap(),
            &table[..],
            "the fork is untouched"
        );
        let r = m.take_rotation().unwrap();
        let moved: Vec<i32> = ev.copies.iter().map(|c| c.dst as i32).collect();
        assert_eq!(r.block_indices, moved, "only the copies are rotated");
        m.check_invariants().unwrap();
    }

    #[test]
    fn eviction_rejects_a_policy_without_room_for_start_and_recent() {
        let mut m = seq_with_scores(2, &[0.; 8]);
        let bad = EvictionPolicy {
            start: 2,
            recent: 2,
            budget: 3,
        };
        assert!(matches!(
            m.evict(1, bad),
            Err(PaError::InvalidArgument { .. })
        ));
        let no_recent = EvictionPolicy {
            start: 0,
            recent: 0,
            budget: 3,
        };
        assert!(m.evict(1, no_recent).is_err());
    }

    #[test]
    fn pending_rotation_is_dropped_when_the_block_is_freed() {
        let mut m = seq_with_scores(2, &[5., 5., 0., 0., 5., 5.]);
        m.evict(
            1,
            EvictionPolicy {
                start: 1,
                recent: 1,
                budget: 2,
            },
        )
        .unwrap();
        assert_eq!(m.pending_rotations().len(), 1);
        m.free(1).unwrap();
        assert!(m.take_rotation().is_none());
    }

    #[test]
    fn backward_lut_row_undoes_forward_row() {
        let d = 8;
        let f = rotation_lut(6, d, 10000.0, RotationDirection::Forward).unwrap();
        let b = rotation_lut(6, d, 10000.0, RotationDirection::Backward).unwrap();
        assert_eq!(
            &f[..d],
            &[1., 1., 1., 1., 0., 0., 0., 0.],
            "row 0 is the identity"
        );
        for m in 0..6 {
            for i in 0..d / 2 {
                let fi = 10000f64.powf(-2.0 * i as f64 / d as f64);
                let want = (m as f64 * fi).sin() as f32;
                assert!((f[m * d + d / 2 + i] - want).abs() < 1e-6);
                assert_eq!(b[m * d + d / 2 + i], -f[m * d + d / 2 + i]);
                assert_eq!(b[m * d + i], f[m * d + i]);
            }
        }
        assert!(rotation_lut(2, 7, 10000.0, RotationDirection::Backward).is_err());
    }
}
