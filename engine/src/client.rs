//! The engine client: the one driver of an engine core. It owns the engine thread (which loads
//! the model, then takes commands and steps), hands out request ids, tokenizes on the caller's
//! thread (the input processor), and sends each request's updates to the reply channel the
//! caller gave with it. A caller that drops its receiver has its request aborted before the
//! next step. `pa generate` and `pa serve` both drive the engine through it; a process may hold
//! several clients, each with its engine core and thread.

use crate::config::EngineConfig;
use crate::engine_core::EngineCore;
use crate::error::{EngineError, Result};
use crate::input_processor::InputProcessor;
use crate::kv_events::KvEventPublisher;
use crate::metrics::Snapshot;
use crate::model_dir::ModelDir;
use crate::request::{Event, GenerationParams, Prompt, RequestError, RequestId, Update};
use paged_attention::cache::{CacheEvent, FinishReason};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where a request's updates go: a channel's sending side. Sending fails once the receiver is
/// gone, which aborts the request.
pub trait Reply: Send + 'static {
    fn send(&self, update: Update) -> bool;
    /// The receiver is gone (checked before every step; a channel that cannot tell says no).
    fn is_closed(&self) -> bool {
        false
    }
}

impl Reply for tokio::sync::mpsc::UnboundedSender<Update> {
    fn send(&self, update: Update) -> bool {
        tokio::sync::mpsc::UnboundedSender::send(self, update).is_ok()
    }
    fn is_closed(&self) -> bool {
        tokio::sync::mpsc::UnboundedSender::is_closed(self)
    }
}

impl Reply for mpsc::Sender<Update> {
    fn send(&self, update: Update) -> bool {
        mpsc::Sender::send(self, update).is_ok()
    }
}

enum Cmd {
    /// Requests the engine adds together, before its next step.
    Add(Vec<Add>),
    AbortAll,
    /// The prefix cache's blocks now, and the number of the last KV-event batch.
    CacheBlocks(mpsc::Sender<CacheBlocks>),
    Stop,
}

/// The blocks a prompt can reuse, as of a KV-event batch: replaying batches up to `seq`
/// gives `hashes`.
#[derive(Clone, Debug)]
pub struct CacheBlocks {
    /// The last batch published (`None`: none yet).
    pub seq: Option<u64>,
    /// Ascending.
    pub hashes: Vec<u64>,
}

struct Add {
    id: RequestId,
    prompt: Vec<u32>,
    params: GenerationParams,
    reply: Box<dyn Reply>,
}

/// A request checked and tokenized ([`EngineClient::prepare`]), ready to submit.
pub struct Prepared {
    prompt: Vec<u32>,
    params: GenerationParams,
}

/// A handle on one engine thread. Dropping it stops the thread (after its current step).
pub struct EngineClient {
    cmds: Mutex<mpsc::Sender<Cmd>>,
    inputs: InputProcessor,
    snapshot: Arc<Mutex<Snapshot>>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The engine thread's answer once the model is loaded (or not).
pub struct Loading(mpsc::Receiver<std::result::Result<(), String>>);

impl Loading {
    /// Waits until the model is compiled and the caches allocated.
    pub fn wait(self) -> std::result::Result<(), String> {
        self.0
            .recv()
            .unwrap_or_else(|_| Err("the engine thread ended".into()))
    }
}

impl EngineClient {
    /// Reads the model directory (configuration, tokenizer) here, then starts the engine thread,
    /// which converts and compiles the model; [`Loading::wait`] says when it is ready.
    pub fn start(dir: impl AsRef<Path>, cfg: EngineConfig) -> Result<(EngineClient, Loading)> {
        EngineClient::from_model_dir(ModelDir::open(dir)?, cfg)
    }

    /// [`EngineClient::start`] on a model directory already read.
    pub fn from_model_dir(md: ModelDir, cfg: EngineConfig) -> Result<(EngineClient, Loading)> {
        let inputs = InputProcessor::new(md.tokenizer.clone(), md.config.max_position_embeddings);
        let snapshot = Arc::new(Mutex::new(Snapshot::default()));
        let (tx, rx) = mpsc::channel();
        let (ltx, lrx) = mpsc::channel();
        let shared = snapshot.clone();
        let publisher = match cfg.kv_events.clone() {
            Some(k) => {
                Some(KvEventPublisher::start(k, cfg.block_size).map_err(EngineError::Config)?)
            }
            None => None,
        };
        let thread = std::thread::Builder::new()
            .name("pa-engine".into())
            .spawn(move || {
                let core = match EngineCore::from_model_dir(md, &cfg) {
                    Ok(core) => core,
                    Err(e) => {
                        let _ = ltx.send(Err(e.to_string()));
                        return;
                    }
                };
                let mut driver = Driver::new(core, shared, publisher);
                driver.run(rx, ltx);
                driver.close();
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        let client = EngineClient {
            cmds: Mutex::new(tx),
            inputs,
            snapshot,
            next_id: AtomicU64::new(0),
            thread: Mutex::new(Some(thread)),
        };
        Ok((client, Loading(lrx)))
    }

    pub fn inputs(&self) -> &InputProcessor {
        &self.inputs
    }

    /// The engine's figures after its last step.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Checks `params`, tokenizes `prompt` on this thread, and queues the request; its updates go
    /// to `reply` (`Accepted` or `Refused` first). A fault found here comes back at once.
    pub fn submit(
        &self,
        prompt: Prompt,
        params: GenerationParams,
        reply: impl Reply,
    ) -> std::result::Result<RequestId, RequestError> {
        let prepared = self.prepare(prompt, params)?;
        let ids = self.submit_prepared(vec![(prepared, Box::new(reply) as Box<dyn Reply>)])?;
        Ok(ids[0])
    }

    /// Checks and tokenizes a request on the caller's thread, without submitting it.
    pub fn prepare(
        &self,
        prompt: Prompt,
        params: GenerationParams,
    ) -> std::result::Result<Prepared, RequestError> {
        params.validate()?;
        let prompt = self.inputs.process(prompt)?;
        Ok(Prepared { prompt, params })
    }

    /// Submits prepared requests together: the engine adds all of them before its next step, so
    /// the schedule of requests that arrive at once does not depend on how fast they were
    /// tokenized. Returns their ids, in order.
    pub fn submit_prepared(
        &self,
        requests: Vec<(Prepared, Box<dyn Reply>)>,
    ) -> std::result::Result<Vec<RequestId>, RequestError> {
        let adds: Vec<Add> = requests
            .into_iter()
            .map(|(p, reply)| Add {
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
                prompt: p.prompt,
                params: p.params,
                reply,
            })
            .collect();
        let ids = adds.iter().map(|a| a.id).collect();
        self.send(Cmd::Add(adds))
            .then_some(ids)
            .ok_or_else(|| RequestError::prompt("the engine has stopped"))
    }

    /// The prefix cache's blocks as of the last KV-event batch; `None` unless KV events are
    /// published (or the engine does not answer within 10 s).
    pub fn cache_blocks(&self) -> Option<CacheBlocks> {
        let (tx, rx) = mpsc::channel();
        if !self.send(Cmd::CacheBlocks(tx)) {
            return None;
        }
        rx.recv_timeout(Duration::from_secs(10)).ok()
    }

    /// Ends every request now (each output gets its `Finished` with reason `abort`).
    pub fn abort_all(&self) {
        self.send(Cmd::AbortAll);
    }

    /// Stops the engine thread after its current step and waits for it.
    pub fn stop(&self) {
        self.send(Cmd::Stop);
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    fn send(&self, cmd: Cmd) -> bool {
        self.cmds
            .lock()
            .map(|c| c.send(cmd).is_ok())
            .unwrap_or(false)
    }
}

impl Drop for EngineClient {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A request's bookkeeping on the engine thread.
struct Client {
    reply: Box<dyn Reply>,
    left: usize,
    added: Instant,
    first: Option<Instant>,
    tokens: usize,
    /// When each output's last token came (inter-token latency).
    last: Vec<Option<Instant>>,
}

/// The engine thread's loop: commands in, steps, updates out.
struct Driver {
    core: EngineCore,
    clients: HashMap<RequestId, Client>,
    snapshot: Arc<Mutex<Snapshot>>,
    figures: Snapshot,
    kv_events: Option<KvEventPublisher>,
}

impl Driver {
    fn new(
        core: EngineCore,
        snapshot: Arc<Mutex<Snapshot>>,
        mut kv_events: Option<KvEventPublisher>,
    ) -> Driver {
        let mut figures = Snapshot::default();
        figures.read_core(&core);
        if let Some(p) = &mut kv_events {
            // Subscribers that knew an earlier process on this endpoint: its cache is gone.
            p.publish(vec![CacheEvent::Cleared]);
        }
        Driver {
            core,
            clients: HashMap::new(),
            snapshot,
            figures,
            kv_events,
        }
    }

    /// After the loop: the cache goes with the process, so subscribers drop its blocks.
    fn close(&mut self) {
        self.drain_kv_events();
        if let Some(p) = &mut self.kv_events {
            p.publish(vec![CacheEvent::Cleared]);
        }
        self.kv_events = None;
    }

    /// Publishes the prefix cache's changes since the last call as one batch.
    fn drain_kv_events(&mut self) {
        let Some(p) = &mut self.kv_events else {
            return;
        };
        let events = self.core.take_cache_events();
        if !events.is_empty() {
            p.publish(events);
        }
        self.figures.kv_events = Some((p.batches(), p.dropped()));
    }

    fn run(
        &mut self,
        rx: mpsc::Receiver<Cmd>,
        loaded: mpsc::Sender<std::result::Result<(), String>>,
    ) {
        self.publish();
        let _ = loaded.send(Ok(()));
        loop {
            // Commands: wait for one when idle, else take what is there.
            let mut cmds = Vec::new();
            if self.core.is_idle() {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(c) => cmds.push(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            cmds.extend(rx.try_iter());
            for cmd in cmds {
                match cmd {
                    Cmd::Stop => return,
                    Cmd::CacheBlocks(reply) => {
                        self.drain_kv_events();
                        if let Some(p) = &self.kv_events {
                            let _ = reply.send(CacheBlocks {
                                seq: p.batches().checked_sub(1),
                                hashes: self.core.cached_block_hashes(),
                            });
                        }
                    }
                    Cmd::AbortAll => {
                        let ids: Vec<RequestId> = self.clients.keys().copied().collect();
                        for id in ids {
                            self.abort(id, true);
                        }
                    }
                    Cmd::Add(adds) => {
                        for a in adds {
                            self.add(a.id, a.prompt, a.params, a.reply);
                        }
                    }
                }
            }
            // Callers that went away: abort before the next step, freeing their blocks.
            let gone: Vec<RequestId> = self
                .clients
                .iter()
                .filter(|(_, c)| c.reply.is_closed())
                .map(|(&id, _)| id)
                .collect();
            for id in gone {
                self.abort(id, false);
            }
            if !self.core.is_idle() {
                self.step();
            }
            self.publish();
        }
    }

    fn add(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: GenerationParams,
        reply: Box<dyn Reply>,
    ) {
        let n = params.n;
        let prompt_tokens = prompt.len();
        match self.core.add_request(id, prompt, params) {
            Ok(()) => {
                reply.send(Update::Accepted {
                    request: id,
                    prompt_tokens,
                });
                let client = Client {
                    reply,
                    left: n,
                    added: Instant::now(),
                    first: None,
                    tokens: 0,
                    last: vec![None; n],
                };
                self.clients.insert(id, client);
            }
            Err(EngineError::Request(error)) => {
                reply.send(Update::Refused { request: id, error });
            }
            Err(e) => {
                reply.send(Update::Refused {
                    request: id,
                    error: RequestError::prompt(e.to_string()),
                });
            }
        }
    }

    /// Aborts a request; its caller hears of it when `tell` (it is still there).
    fn abort(&mut self, id: RequestId, tell: bool) {
        let Some(c) = self.clients.remove(&id) else {
            return;
        };
        let events = self.core.abort(id).unwrap_or_default();
        if tell {
            for e in events {
                c.reply.send(Update::Event(e));
            }
        }
        self.figures.count_finished(FinishReason::Abort);
    }

    fn step(&mut self) {
        let events = match self.core.step() {
            Ok(events) => events,
            Err(EngineError::StepFailed { requests, message }) => {
                // The core ended the step's requests and freed their blocks; the others go on.
                eprintln!("pa-engine: a model run failed: {message}");
                for id in requests {
                    if let Some(c) = self.clients.remove(&id) {
                        c.reply.send(Update::Failed {
                            request: id,
                            message: format!("the engine failed: {message}"),
                        });
                    }
                }
                return;
            }
            Err(e) => {
                // A failed step fails the requests in it; the engine goes on.
                eprintln!("pa-engine: engine step failed: {e}");
                for (id, c) in self.clients.drain() {
                    c.reply.send(Update::Failed {
                        request: id,
                        message: format!("the engine failed: {e}"),
                    });
                    let _ = self.core.abort(id);
                }
                return;
            }
        };
        let mut lost = Vec::new();
        for e in events {
            let request = e.request();
            let Some(c) = self.clients.get_mut(&request) else {
                continue;
            };
            let end = match &e {
                Event::Finished { reason, .. } => Some(*reason),
                _ => None,
            };
            if let Event::Token { index, .. } = &e {
                let now = Instant::now();
                if c.first.is_none() {
                    c.first = Some(now);
                    self.figures.ttft.observe((now - c.added).as_secs_f64());
                }
                if let Some(last) = c.last.get_mut(*index) {
                    if let Some(t) = last.replace(now) {
                        self.figures.itl.observe((now - t).as_secs_f64());
                    }
                }
                c.tokens += 1;
            }
            let is_end = end.is_some();
            let ok = c.reply.send(Update::Event(e));
            if is_end {
                c.left -= 1;
                if c.left == 0 {
                    if let (Some(first), true) = (c.first, c.tokens > 1) {
                        self.figures
                            .tpot
                            .observe(first.elapsed().as_secs_f64() / (c.tokens - 1) as f64);
                    }
                    self.figures.e2e.observe(c.added.elapsed().as_secs_f64());
                    if let Some(reason) = end {
                        self.figures.count_finished(reason);
                    }
                    self.clients.remove(&request);
                    continue;
                }
            }
            if !ok {
                lost.push(request);
            }
        }
        lost.sort_unstable();
        lost.dedup();
        for id in lost {
            self.abort(id, false);
        }
    }

    fn publish(&mut self) {
        self.drain_kv_events();
        self.figures.read_core(&self.core);
        if let Ok(mut s) = self.snapshot.lock() {
            s.clone_from(&self.figures);
        }
    }
}
