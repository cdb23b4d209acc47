//! KV-cache events for routers (`pa serve --kv-events-endpoint`): the prefix cache's changes
//! (blocks stored, removed, all cleared), published on a ZeroMQ PUB socket in vLLM's format, so
//! that a prefix-aware router (llm-d's precise prefix-cache scorer) reads them unchanged.
//!
//! The format is vLLM's `vllm/distributed/kv_events.py` as of vLLM 0.11 to 0.23 (docs/api.md,
//! "KV-cache events"): each message is three frames, `[topic, sequence number (8 bytes,
//! big-endian), payload]`; the payload is a msgpack `KVEventBatch` array `[ts, events,
//! data_parallel_rank]` whose events are tagged arrays, `["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
//! `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]` ([`Shape::Array`]); or,
//! as vLLM writes them since its events became maps (vLLM PR 42892), maps of the same fields
//! under their names with the tag under `type` ([`Shape::Map`]). Hashes are the 64-bit block
//! hashes the prefix cache matches on, as msgpack unsigned integers.
//!
//! The engine thread never waits on the socket: it hands each step's batch to the publisher's
//! thread through a bounded channel, and a batch that does not fit is dropped and counted (its
//! sequence number is skipped, so a subscriber sees the gap).

use crate::config::named;
use bytes::Bytes;
use paged_attention::cache::CacheEvent;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc as queue;
use zeromq::{Socket, SocketSend};

/// How events are laid out inside a batch (the batch itself is an array in both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Shape {
    /// Positional arrays: vLLM up to 0.23, and every subscriber that reads vLLM's events.
    #[default]
    Array,
    /// Maps keyed by field name: vLLM since its PR 42892.
    Map,
}

named!(Shape, "KV-event format", { Array => "array", Map => "map" });

/// Where and how events are published.
#[derive(Clone, Debug)]
pub struct KvEventsConfig {
    /// `tcp://*:PORT` or `tcp://0.0.0.0:PORT` binds (subscribers connect); `tcp://HOST:PORT`
    /// connects (to a subscriber that binds), vLLM's rule.
    pub endpoint: String,
    /// The first frame of every message (llm-d reads `kv@POD@MODEL`).
    pub topic: String,
    pub shape: Shape,
}

/// Batches waiting for the socket at most; more are dropped (and counted).
const QUEUE_BATCHES: usize = 10_000;

/// One step's events, numbered.
struct Batch {
    seq: u64,
    ts: f64,
    events: Vec<CacheEvent>,
}

/// The engine's side of the publisher: numbers batches and hands them over without waiting.
pub struct KvEventPublisher {
    tx: Option<queue::Sender<Batch>>,
    next_seq: u64,
    block_size: usize,
    dropped: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KvEventPublisher {
    /// Opens the socket on a thread of its own; a bind that fails is an error here.
    pub fn start(cfg: KvEventsConfig, block_size: usize) -> Result<KvEventPublisher, String> {
        let (tx, rx) = queue::channel::<Batch>(QUEUE_BATCHES);
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("pa-kv-events".into())
            .spawn(move || publish_loop(cfg, block_size, rx, ready_tx))
            .map_err(|e| format!("cannot start the KV-event thread: {e}"))?;
        match ready_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err("the KV-event socket did not open within 30 s".into()),
        }
        Ok(KvEventPublisher {
            tx: Some(tx),
            next_seq: 0,
            block_size,
            dropped: Arc::new(AtomicU64::new(0)),
            thread: Some(thread),
        })
    }

    /// Hands `events` over as the next batch; returns its sequence number. Never waits: when
    /// the queue is full the batch is dropped and counted.
    pub fn publish(&mut self, events: Vec<CacheEvent>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let batch = Batch {
            seq,
            ts: now_secs(),
            events,
        };
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.try_send(batch).is_ok());
        if !sent {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        seq
    }

    /// Batches numbered so far (the next batch's number).
    pub fn batches(&self) -> u64 {
        self.next_seq
    }

    /// Batches dropped because the queue to the socket was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
}

impl Drop for KvEventPublisher {
    /// Sends what is queued (for a second at most), then closes the socket.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// vLLM's bind-or-connect rule: bind when the host is a wildcard; `*` becomes 0.0.0.0 (the
/// ZeroMQ crate binds addresses, not wildcards).
fn bind_address(endpoint: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    if let Some(port) = rest.strip_prefix("*:") {
        return Some(format!("tcp://0.0.0.0:{port}"));
    }
    (rest.starts_with("0.0.0.0:") || rest.starts_with("[::]:")).then(|| endpoint.to_string())
}

/// The publisher thread: opens the socket, then sends batches until the engine's side is gone.
fn publish_loop(
    cfg: KvEventsConfig,
    block_size: usize,
    mut rx: queue::Receiver<Batch>,
    ready: mpsc::Sender<Result<(), String>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start the KV-event runtime: {e}")));
            return;
        }
    };
    rt.block_on(async move {
        let mut socket = zeromq::PubSocket::new();
        let bind = bind_address(&cfg.endpoint);
        if !cfg.endpoint.starts_with("tcp://") {
            let _ = ready.send(Err(format!(
                "--kv-events-endpoint {}: only tcp://HOST:PORT endpoints are served",
                cfg.endpoint
            )));
            return;
        }
        if let Some(addr) = &bind {
            if let Err(e) = socket.bind(addr).await {
                let _ = ready.send(Err(format!(
                    "cannot bind the KV-event socket to {addr}: {e}"
                )));
                return;
            }
        }
        let _ = ready.send(Ok(()));
        let mut connected = bind.is_some();
        let mut warned = false;
        // Until the engine's side is dropped.
        while let Some(batch) = rx.recv().await {
            if !connected {
                // Connect mode: the subscriber binds; until it is there, batches are dropped.
                let attempt =
                    tokio::time::timeout(Duration::from_secs(1), socket.connect(&cfg.endpoint));
                match attempt.await {
                    Ok(Ok(())) => connected = true,
                    Ok(Err(e)) if !warned => {
                        eprintln!(
                            "pa serve: KV events: cannot connect to {} yet: {e}",
                            cfg.endpoint
                        );
                        warned = true;
                    }
                    _ => {}
                }
            }
            let mut msg = zeromq::ZmqMessage::from(cfg.topic.clone().into_bytes());
            msg.push_back(Bytes::copy_from_slice(&batch.seq.to_be_bytes()));
            msg.push_back(Bytes::from(encode_batch(
                batch.ts,
                &batch.events,
                block_size,
                cfg.shape,
            )));
            if connected {
                // A PUB socket drops what a slow subscriber cannot take; it does not wait.
                let _ = socket.send(msg).await;
            }
        }
        // Let the last batches leave before the socket closes.
        let _ = tokio::time::timeout(Duration::from_secs(1), socket.close()).await;
    });
}

/// The msgpack payload of one batch: `[ts, [event...], 0]` (data-parallel rank 0).
pub fn encode_batch(ts: f64, events: &[CacheEvent], block_size: usize, shape: Shape) -> Vec<u8> {
    let mut out = Vec::new();
    let groups = group(events);
    let w = &mut out;
    // Writing to a Vec cannot fail.
    let _ = rmp::encode::write_array_len(w, 3);
    let _ = rmp::encode::write_f64(w, ts);
    let _ = rmp::encode::write_array_len(w, groups.len() as u32);
    for g in &groups {
        write_event(w, g, block_size, shape);
    }
    let _ = rmp::encode::write_uint(w, 0);
    out
}

/// Events as vLLM sends them: a run of stored blocks each the child of the one before becomes
/// one BlockStored (its parent is the first block's parent); a run of removals one BlockRemoved.
enum Group<'a> {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<&'a [u32]>,
    },
    Removed(Vec<u64>),
    Cleared,
}

fn group(events: &[CacheEvent]) -> Vec<Group<'_>> {
    let mut out: Vec<Group> = Vec::new();
    for e in events {
        match (e, out.last_mut()) {
            (
                CacheEvent::Stored {
                    hash,
                    parent: Some(p),
                    tokens,
                },
                Some(Group::Stored {
                    hashes, tokens: t, ..
                }),
            ) if hashes.last() == Some(p) => {
                hashes.push(*hash);
                t.push(tokens);
            }
            (CacheEvent::Removed { hash }, Some(Group::Removed(hashes))) => hashes.push(*hash),
            (
                CacheEvent::Stored {
                    hash,
                    parent,
                    tokens,
                },
                _,
            ) => out.push(Group::Stored {
                hashes: vec![*hash],
                parent: *parent,
                tokens: vec![tokens],
            }),
            (CacheEvent::Removed { hash }, _) => out.push(Group::Removed(vec![*hash])),
            (CacheEvent::Cleared, _) => out.push(Group::Cleared),
        }
    }
    out
}

/// One event: its tag and fields, as a positional array or as a map of field names.
fn write_event(w: &mut Vec<u8>, g: &Group, block_size: usize, shape: Shape) {
    let (tag, nfields) = match g {
        Group::Stored { .. } => ("BlockStored", 7),
        Group::Removed(_) => ("BlockRemoved", 2),
        Group::Cleared => ("AllBlocksCleared", 0),
    };
    let _ = match shape {
        Shape::Array => rmp::encode::write_array_len(w, 1 + nfields),
        Shape::Map => rmp::encode::write_map_len(w, 1 + nfields),
    };
    let field = |w: &mut Vec<u8>, name: &str| {
        if shape == Shape::Map {
            let _ = rmp::encode::write_str(w, name);
        }
    };
    field(w, "type");
    let _ = rmp::encode::write_str(w, tag);
    let hashes = |w: &mut Vec<u8>, hs: &[u64]| {
        field(w, "block_hashes");
        let _ = rmp::encode::write_array_len(w, hs.len() as u32);
        for &h in hs {
            let _ = rmp::encode::write_uint(w, h);
        }
    };
    match g {
        Group::Stored {
            hashes: hs,
            parent,
            tokens,
        } => {
            hashes(w, hs);
            field(w, "parent_block_hash");
            match parent {
                Some(p) => {
                    let _ = rmp::encode::write_uint(w, *p);
                }
                None => {
                    let _ = rmp::encode::write_nil(w);
                }
            }
            field(w, "token_ids");
            let n: usize = tokens.iter().map(|t| t.len()).sum();
            let _ = rmp::encode::write_array_len(w, n as u32);
            for &t in tokens.iter().flat_map(|t| t.iter()) {
                let _ = rmp::encode::write_uint(w, t as u64);
            }
            field(w, "block_size");
            let _ = rmp::encode::write_uint(w, block_size as u64);
            // No LoRA; the medium is left unsaid (subscribers take it for the engine's own
            // tier, which this cache is).
            for name in ["lora_id", "medium", "lora_name"] {
                field(w, name);
                let _ = rmp::encode::write_nil(w);
            }
        }
        Group::Removed(hs) => {
            hashes(w, hs);
            field(w, "medium");
            let _ = rmp::encode::write_nil(w);
        }
        Group::Cleared => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64, parent: Option<u64>, tokens: &[u32]) -> CacheEvent {
        CacheEvent::Stored {
            hash,
            parent,
            tokens: tokens.into(),
        }
    }

    /// Bytes written by hand from the msgpack spec and vLLM's schema.
    #[test]
    fn array_batch_matches_hand_written_bytes() {
        let events = [
            stored(7, None, &[1, 2]),
            stored(0xffff_ffff_ffff_fff0, Some(7), &[3, 300]),
            CacheEvent::Removed { hash: 5 },
            CacheEvent::Removed { hash: 6 },
            CacheEvent::Cleared,
        ];
        let got = encode_batch(1.5, &events, 2, Shape::Array);
        let mut want = vec![0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]; // [1.5,
        want.push(0x93); // three events (the two stored blocks are one chain)
        want.push(0x98); // ["BlockStored", 7 fields]
        want.extend(b"\xabBlockStored");
        want.extend([
            0x92, 0x07, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xf0,
        ]);
        want.push(0xc0); // parent: nil
        want.extend([0x94, 0x01, 0x02, 0x03, 0xcd, 0x01, 0x2c]); // token ids
        want.push(0x02); // block size
        want.extend([0xc0, 0xc0, 0xc0]); // lora_id, medium, lora_name
        want.push(0x93);
        want.extend(b"\xacBlockRemoved");
        want.extend([0x92, 0x05, 0x06, 0xc0]);
        want.push(0x91);
        want.extend(b"\xb0AllBlocksCleared");
        want.push(0x00); // data_parallel_rank
        assert_eq!(got, want);
    }

    #[test]
    fn map_events_carry_field_names() {
        let got = encode_batch(0.0, &[CacheEvent::Removed { hash: 9 }], 16, Shape::Map);
        let mut want = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
        want.push(0x83); // {type, block_hashes, medium}
        want.extend(b"\xa4type\xacBlockRemoved");
        want.extend(b"\xacblock_hashes\x91\x09");
        want.extend(b"\xa6medium\xc0");
        want.push(0x00);
        assert_eq!(got, want);
        let stored = encode_batch(0.0, &[stored(1, Some(2), &[4])], 1, Shape::Map);
        assert_eq!(stored[11], 0x88, "type and 7 fields");
        assert!(stored
            .windows(19)
            .any(|w| w == b"\xb1parent_block_hash\x02"));
    }

    #[test]
    fn a_stored_block_whose_parent_is_not_the_last_starts_a_new_event() {
        let events = [stored(1, None, &[1]), stored(2, Some(9), &[2])];
        let g = group(&events);
        assert_eq!(g.len(), 2);
        assert!(matches!(
            &g[1],
            Group::Stored {
                parent: Some(9),
                ..
            }
        ));
    }

    #[test]
    fn wildcard_hosts_bind_and_others_connect() {
        assert_eq!(
            bind_address("tcp://*:5557").as_deref(),
            Some("tcp://0.0.0.0:5557")
        );
        assert!(bind_address("tcp://0.0.0.0:1").is_some());
        assert_eq!(bind_address("tcp://router:5557"), None);
    }
}
