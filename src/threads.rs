//! Where the work of one call runs: the library's own thread pool, the caller's rayon pool, the
//! calling thread alone, or a parallel-for the host hands in (OpenVINO's TBB arena through the
//! extension, any C caller's pool through `pa_execute_ex`; the pattern of oneDNN's threadpool
//! interop and XNNPACK's pthreadpool).
//!
//! Every parallel region of the kernels is one [`Runner::for_each`] over independent items.
//! Whichever thread is free claims the next item from a shared counter, so uneven items
//! balance; an item's result never depends on the thread that runs it, so results are
//! bit-identical for every runner and thread count.
//!
//! The library's pool is built on first use. Its size is, in order: [`set_num_threads`]
//! (`pa_set_num_threads`), `PA_NUM_THREADS`, the number of CPUs the process may run on. Its
//! workers run on the process's CPU set (the affinity of the thread that loaded the library, or
//! of the main thread), never on the narrowed set of the thread that happened to make the first
//! call: a host that pins its worker threads (OpenVINO does by default) would otherwise squeeze
//! every worker onto one core.

use std::any::Any;
use std::ffi::c_void;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{PaError, Result};

/// `task(task_ctx, worker)`: the host calls it once for each `worker` in `0..n`.
pub type TaskFn = unsafe extern "C" fn(task_ctx: *mut c_void, worker: usize);

/// The host's parallel-for: calls `task(task_ctx, i)` exactly once for every `i < n`, on any of
/// its threads, and returns when all of those calls have returned.
pub type ParallelForFn =
    unsafe extern "C" fn(runner_ctx: *mut c_void, n: usize, task: TaskFn, task_ctx: *mut c_void);

/// A parallel-for supplied by the host (`pa_runner` in the header).
#[derive(Clone, Copy, Debug)]
pub struct HostRunner {
    pub parallel_for: ParallelForFn,
    pub ctx: *mut c_void,
    /// How many of the host's threads may work at once (at least 1 is assumed).
    pub threads: usize,
}

// SAFETY: a HostRunner is only used by calling `parallel_for` from the thread that makes the
// op call (never from inside an item); the header requires the runner to stay valid for that
// call. Being Send/Sync only lets options holding it be captured by the items' closures.
unsafe impl Send for HostRunner {}
// SAFETY: as above.
unsafe impl Sync for HostRunner {}

/// How the parallel regions of a call run.
#[derive(Clone, Copy, Debug, Default)]
pub enum Runner {
    /// On the rayon pool of the calling thread when it is a rayon worker (a Rust host inside
    /// `ThreadPool::install` keeps control of its threads), else on the library's own pool.
    #[default]
    Auto,
    /// Everything on the calling thread.
    Serial,
    /// On the host's threads, through its parallel-for.
    Host(HostRunner),
    /// Inside [`Runner::region`] of a host runner: on the team of host threads that entered
    /// the region, which stays for every parallel region of the call.
    Team(TeamRef),
}

/// Which kind of thread ran the items of past calls (see [`item_counts`]). Feature
/// `test-hooks` only.
#[cfg(feature = "test-hooks")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ItemCounts {
    /// Items run by the library's own pool workers.
    pub pool: u64,
    /// Items run inside a task of a host's parallel-for.
    pub host: u64,
    /// Items run by any other thread (the caller, or the caller's rayon pool).
    pub other: u64,
}

/// The kinds of thread the item counters of the test hooks tell apart.
#[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
#[derive(Clone, Copy)]
enum Kind {
    Pool = 0,
    Host = 1,
    Other = 2,
}

/// The thread-kind counters of the test hooks. Without the feature there is neither counter
/// nor thread-local, and an item costs nothing beyond its own work.
#[cfg(feature = "test-hooks")]
mod kind {
    use super::Kind;
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};

    pub(super) static ITEMS: [AtomicU64; 3] =
        [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

    thread_local! {
        /// Set once in each of the library's pool workers; set around a host task's items.
        static KIND: Cell<usize> = const { Cell::new(Kind::Other as usize) };
    }

    /// Marks the calling thread as one of the library's pool workers, for good.
    pub(super) fn mark_pool_worker() {
        KIND.with(|k| k.set(Kind::Pool as usize));
    }

    /// Runs `f` with the calling thread counted as `kind`.
    pub(super) fn with<R>(kind: Kind, f: impl FnOnce() -> R) -> R {
        let before = KIND.with(|k| k.replace(kind as usize));
        let r = f();
        KIND.with(|k| k.set(before));
        r
    }

    /// Counts one item run by the calling thread.
    pub(super) fn count_item() {
        ITEMS[KIND.with(Cell::get)].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(not(feature = "test-hooks"))]
mod kind {
    use super::Kind;

    #[inline(always)]
    pub(super) fn mark_pool_worker() {}

    #[inline(always)]
    pub(super) fn with<R>(_kind: Kind, f: impl FnOnce() -> R) -> R {
        f()
    }

    #[inline(always)]
    pub(super) fn count_item() {}
}

/// Items run so far in this process, by the kind of thread that ran them (three relaxed
/// counters, one increment per item). Feature `test-hooks` only: tests use it to check where
/// the work went.
#[cfg(feature = "test-hooks")]
pub fn item_counts() -> ItemCounts {
    use std::sync::atomic::Ordering;
    let get = |k: Kind| kind::ITEMS[k as usize].load(Ordering::Relaxed);
    ItemCounts {
        pool: get(Kind::Pool),
        host: get(Kind::Host),
        other: get(Kind::Other),
    }
}

/// The time of every item of the parallel regions run on [`Runner::Serial`] while a log is
/// open (feature `test-hooks`, never in the shipped library): what `examples/scaling_sim.rs`
/// replays onto more threads.
#[cfg(feature = "test-hooks")]
pub mod timing {
    use std::sync::Mutex;
    use std::time::Instant;

    /// One item: its region (in the order the call ran them), its index there, and its time.
    #[derive(Clone, Copy, Debug)]
    pub struct ItemTime {
        pub region: u32,
        pub item: u32,
        pub ns: u64,
    }

    /// What a log holds when it is closed: every item's time, and the time the log's own
    /// bookkeeping took outside the items (allocating and filing each region's times, in
    /// memory a call's traffic has evicted: 6-40 us per decode call of four regions, measured),
    /// which the shipped library never spends and a replay leaves out of a call's time.
    #[derive(Debug, Default)]
    pub struct Log {
        pub items: Vec<ItemTime>,
        pub hook_ns: u64,
        regions: u32,
    }

    /// The open log.
    static LOG: Mutex<Option<Log>> = Mutex::new(None);

    /// Threads a serial runner reports to the partition while a log is open (see [`start`]).
    static PLAN_FOR: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

    /// Opens a fresh log; until [`stop`], serial calls cut their work as for `threads` threads
    /// (what a replay onto that many threads needs), and run it on the calling thread.
    pub fn start(threads: usize) {
        PLAN_FOR.store(threads.max(1), std::sync::atomic::Ordering::Relaxed);
        *LOG.lock().unwrap_or_else(|e| e.into_inner()) = Some(Log::default());
    }

    pub(super) fn threads_to_plan_for() -> usize {
        if on() {
            PLAN_FOR.load(std::sync::atomic::Ordering::Relaxed)
        } else {
            1
        }
    }

    /// Closes the log and returns it.
    pub fn stop() -> Log {
        PLAN_FOR.store(1, std::sync::atomic::Ordering::Relaxed);
        let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
        log.take().unwrap_or_default()
    }

    pub(super) fn on() -> bool {
        LOG.lock().map(|l| l.is_some()).unwrap_or(false)
    }

    /// A serial region with each item timed.
    pub(super) fn serial_for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
        let entered = Instant::now();
        let mut times = Vec::with_capacity(n);
        let first = Instant::now();
        let mut t0 = first;
        for i in 0..n {
            super::run_item(f, i);
            // One clock read per item: its overhead counts in the item, not in the serial time.
            let t1 = Instant::now();
            times.push((t1 - t0).as_nanos() as u64);
            t0 = t1;
        }
        if let Some(log) = LOG.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            let region = log.regions;
            log.regions += 1;
            log.items
                .extend(times.iter().enumerate().map(|(i, &ns)| ItemTime {
                    region,
                    item: i as u32,
                    ns,
                }));
            log.hook_ns += ((first - entered) + t0.elapsed()).as_nanos() as u64;
        }
    }
}

fn run_item(f: &(dyn Fn(usize) + Sync), i: usize) {
    f(i);
    kind::count_item();
}

impl Runner {
    /// Runs `f(i)` once for every `i < n` and returns when all have returned. A panic in `f`
    /// is passed on to the caller (after every started item has finished).
    pub fn for_each(self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        match self {
            #[cfg(feature = "test-hooks")]
            Runner::Serial if timing::on() => timing::serial_for_each(n, f),
            Runner::Serial => (0..n).for_each(|i| run_item(f, i)),
            Runner::Auto if rayon::current_thread_index().is_some() => rayon_for_each(n, f),
            Runner::Auto => match library_pool() {
                Some(pool) => pool.install(|| rayon_for_each(n, f)),
                None => (0..n).for_each(|i| run_item(f, i)),
            },
            Runner::Host(h) => host_for_each(h, n, f),
            Runner::Team(t) => t.team().for_each(n, f),
        }
    }

    /// Runs `body` with the runner its parallel regions should use. For a host runner, that is
    /// one region of the host's parallel-for for the whole of `body`: one host task runs `body`
    /// and the others join each of its [`Runner::for_each`] regions as helpers, so a call pays
    /// the host's fork/join cost (waking its threads) once, not once per region. Every other
    /// runner gives `body` itself. A panic in `body` or in an item is passed on to the caller.
    pub fn region<R: Send>(self, body: impl FnOnce(Runner) -> R + Send) -> R {
        match self {
            Runner::Host(h) if h.threads > 1 => team_region(h, body),
            r => body(r),
        }
    }

    /// How many threads a region may use at most (for sizing per-thread work, never results).
    pub fn max_threads(self) -> usize {
        match self {
            #[cfg(feature = "test-hooks")]
            Runner::Serial => timing::threads_to_plan_for(),
            #[cfg(not(feature = "test-hooks"))]
            Runner::Serial => 1,
            Runner::Auto if rayon::current_thread_index().is_some() => rayon::current_num_threads(),
            Runner::Auto => num_threads(),
            Runner::Host(h) => h.threads.max(1),
            Runner::Team(t) => t.team().threads,
        }
    }
}

/// Runs `f` where [`Runner::Auto`] would run items: on the calling thread's rayon pool when
/// it has one, else inside the library's pool, so rayon code in `f` (the reference kernels)
/// never starts rayon's global pool from a host's pinned thread.
pub fn in_auto_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    match library_pool() {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

fn rayon_for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    use rayon::prelude::*;
    (0..n)
        .into_par_iter()
        .with_max_len(1)
        .for_each(|i| run_item(f, i));
}

/// Where the first panic of a region's tasks waits for the calling thread.
type PanicSlot = Mutex<Option<Box<dyn Any + Send>>>;

/// Keeps `p` unless an earlier panic is kept already.
fn keep_panic(slot: &PanicSlot, p: Box<dyn Any + Send>) {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert(p);
}

/// Re-raises the kept panic, if any, on the calling thread.
fn reraise(slot: &PanicSlot) {
    let p = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let Some(p) = p {
        resume_unwind(p);
    }
}

/// The state a host's tasks share: the next unclaimed item and the first panic.
struct HostRegion<'a> {
    next: AtomicUsize,
    n: usize,
    f: &'a (dyn Fn(usize) + Sync),
    panic: PanicSlot,
}

impl HostRegion<'_> {
    /// Claims and runs items until none is left.
    fn drain(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            run_item(self.f, i);
        }
    }
}

/// The task handed to the host: runs items on the host's thread until none is left. Never
/// unwinds into the host: a panic is kept for the calling thread to re-raise.
unsafe extern "C" fn host_task(task_ctx: *mut c_void, _worker: usize) {
    // SAFETY: `task_ctx` is the `HostRegion` that `host_for_each` passed to the host's
    // parallel-for, which lives until that call returns, i.e. after every task has returned.
    let region = unsafe { &*(task_ctx as *const HostRegion<'_>) };
    let r = kind::with(Kind::Host, || {
        catch_unwind(AssertUnwindSafe(|| region.drain()))
    });
    if let Err(p) = r {
        // Stop the other tasks from claiming more items.
        region.next.store(region.n, Ordering::Relaxed);
        keep_panic(&region.panic, p);
    }
}

fn host_for_each(h: HostRunner, n: usize, f: &(dyn Fn(usize) + Sync)) {
    let region = HostRegion {
        next: AtomicUsize::new(0),
        n,
        f,
        panic: Mutex::new(None),
    };
    let workers = h.threads.clamp(1, n);
    // SAFETY: the header's contract for a pa_runner: `parallel_for` calls `host_task` with our
    // context once per worker and returns after they all returned; `region` outlives the call.
    unsafe {
        (h.parallel_for)(
            h.ctx,
            workers,
            host_task,
            &region as *const HostRegion<'_> as *mut c_void,
        )
    };
    reraise(&region.panic);
    // A runner that skipped tasks leaves items unclaimed: run them here rather than lose them.
    region.drain();
}

// ---- a team of host threads for the whole of a call ----

/// How long a helper waits for the next region of its team before leaving it (the driver's
/// serial steps between regions take microseconds; the items of a helper that left are run by
/// the driver and the other helpers, so leaving early costs speed, never results).
const HELPER_PATIENCE: std::time::Duration = std::time::Duration::from_millis(2);

/// The region a team is working on: `f` and its unclaimed items.
struct Work {
    /// Lifetime erased: `Team::for_each` clears it before its `f` goes out of scope, and waits
    /// for every claimed item first.
    f: Option<&'static (dyn Fn(usize) + Sync)>,
    n: usize,
    next: usize,
}

/// The host threads working on one call.
struct Team {
    threads: usize,
    work: Mutex<Work>,
    /// Bumped when a region is published, so idle helpers look for work.
    generation: AtomicU64,
    /// Items of the current region that have returned.
    done: AtomicUsize,
    /// The driver has returned: helpers leave.
    closed: std::sync::atomic::AtomicBool,
    panic: PanicSlot,
}

/// A [`Runner::Team`]: the team of the region the call runs in.
#[derive(Clone, Copy, Debug)]
pub struct TeamRef(*const c_void);

// SAFETY: a TeamRef points to the `Team` of a `team_region` call and is only handed to the body
// of that region, which returns before the team is dropped; `Team` itself is Sync.
unsafe impl Send for TeamRef {}
// SAFETY: as above.
unsafe impl Sync for TeamRef {}

impl TeamRef {
    fn team(&self) -> &Team {
        // SAFETY: see the Send impl: the team outlives every runner that refers to it.
        unsafe { &*(self.0 as *const Team) }
    }
}

impl Team {
    /// Claims the next item of the current region, if one is left.
    fn claim(&self) -> Option<(&'static (dyn Fn(usize) + Sync), usize)> {
        let mut w = self.work.lock().unwrap_or_else(PoisonError::into_inner);
        let f = w.f?;
        if w.next >= w.n {
            return None;
        }
        w.next += 1;
        Some((f, w.next - 1))
    }

    /// Runs claimed item `i`; a panic is kept for the driver and stops further claims.
    fn run(&self, f: &(dyn Fn(usize) + Sync), i: usize) {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| run_item(f, i))) {
            let mut w = self.work.lock().unwrap_or_else(PoisonError::into_inner);
            w.next = w.n;
            drop(w);
            keep_panic(&self.panic, p);
        }
        self.done.fetch_add(1, Ordering::Release);
    }

    /// One parallel region, run by the driver with whichever helpers are in the team.
    fn for_each(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        // SAFETY: the 'static reference never outlives `f`: it is cleared below, after `done`
        // shows that every claimed item has returned, and no item can be claimed after
        // `next == n` (claims happen under the lock that clears it).
        let fs: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        self.done.store(0, Ordering::Relaxed);
        *self.work.lock().unwrap_or_else(PoisonError::into_inner) = Work {
            f: Some(fs),
            n,
            next: 0,
        };
        self.generation.fetch_add(1, Ordering::Release);
        while let Some((f, i)) = self.claim() {
            self.run(f, i);
        }
        // Items claimed by helpers may still run; the counter says when all have returned
        // (a panicked region stopped claiming, so fewer than `n` ran).
        loop {
            let claimed = self
                .work
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .next
                .min(n);
            if self.done.load(Ordering::Acquire) >= claimed {
                break;
            }
            std::hint::spin_loop();
        }
        self.work.lock().unwrap_or_else(PoisonError::into_inner).f = None;
        reraise(&self.panic);
    }

    /// A helper: runs items of the driver's regions until the driver returns, or until no
    /// region came for [`HELPER_PATIENCE`].
    fn help(&self) {
        let mut idle_since = std::time::Instant::now();
        let mut seen = u64::MAX;
        let mut spins = 0u32;
        while !self.closed.load(Ordering::Acquire) {
            let g = self.generation.load(Ordering::Acquire);
            if g != seen {
                while let Some((f, i)) = self.claim() {
                    self.run(f, i);
                }
                seen = g;
                idle_since = std::time::Instant::now();
                continue;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(256) && idle_since.elapsed() > HELPER_PATIENCE {
                return;
            }
        }
    }
}

/// What the host's tasks of a team region share.
struct TeamRegion<'a, B, R> {
    team: Team,
    body: Mutex<Option<B>>,
    result: Mutex<Option<std::thread::Result<R>>>,
    _scope: std::marker::PhantomData<&'a ()>,
}

impl<B: FnOnce(Runner) -> R, R> TeamRegion<'_, B, R> {
    /// The first task to arrive drives (runs the body), the others help.
    fn enter(&self) {
        let body = self
            .body
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match body {
            Some(body) => {
                let runner = Runner::Team(TeamRef(&self.team as *const Team as *const c_void));
                let r = catch_unwind(AssertUnwindSafe(|| body(runner)));
                self.team.closed.store(true, Ordering::Release);
                *self.result.lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
            }
            None => self.team.help(),
        }
    }
}

unsafe extern "C" fn team_task<B: FnOnce(Runner) -> R, R>(task_ctx: *mut c_void, _worker: usize) {
    // SAFETY: `task_ctx` is the `TeamRegion` that `team_region` passed to the host's
    // parallel-for, alive until that call returns, i.e. after every task has returned.
    let region = unsafe { &*(task_ctx as *const TeamRegion<'_, B, R>) };
    // `enter` catches the body's panics and `help` those of items; nothing else can unwind,
    // but the host must never see an unwind.
    let _ = kind::with(Kind::Host, || {
        catch_unwind(AssertUnwindSafe(|| region.enter()))
    });
}

fn team_region<R: Send>(h: HostRunner, body: impl FnOnce(Runner) -> R + Send) -> R {
    let region = TeamRegion {
        team: Team {
            threads: h.threads,
            work: Mutex::new(Work {
                f: None,
                n: 0,
                next: 0,
            }),
            generation: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            closed: std::sync::atomic::AtomicBool::new(false),
            panic: Mutex::new(None),
        },
        body: Mutex::new(Some(body)),
        result: Mutex::new(None),
        _scope: std::marker::PhantomData,
    };
    fn task_of<B: FnOnce(Runner) -> R, R>(_: &TeamRegion<'_, B, R>) -> TaskFn {
        team_task::<B, R>
    }
    // SAFETY: the header's contract for a pa_runner: `parallel_for` calls the task with our
    // context once per worker and returns after they all returned; `region` outlives the call.
    // The body may run on a host thread: it is Send, and this thread waits for it.
    unsafe {
        (h.parallel_for)(
            h.ctx,
            h.threads,
            task_of(&region),
            &region as *const TeamRegion<'_, _, R> as *mut c_void,
        )
    };
    // A runner that skipped every task never ran the body: run it here, without helpers.
    region.enter();
    let result = region
        .result
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    match result {
        Some(Ok(r)) => r,
        Some(Err(p)) => resume_unwind(p),
        None => unreachable!("the body ran in a task or above"),
    }
}

// ---- the library's own pool ----

/// Most threads the pool may be given (a guard against nonsense, not a tuning knob).
pub const MAX_THREADS: usize = 4096;

struct PoolState {
    pool: Option<Arc<rayon::ThreadPool>>,
    /// 0: not set through the API.
    requested: usize,
}

static STATE: Mutex<PoolState> = Mutex::new(PoolState {
    pool: None,
    requested: 0,
});

fn state() -> std::sync::MutexGuard<'static, PoolState> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sets the size of the library's pool (0: back to `PA_NUM_THREADS` or the CPU count). Takes
/// effect at the next call; calls already running finish on the pool they started with.
pub fn set_num_threads(n: usize) -> Result<()> {
    if n > MAX_THREADS {
        return Err(PaError::InvalidArgument {
            detail: format!("num_threads = {n}; at most {MAX_THREADS}"),
        });
    }
    let mut st = state();
    st.requested = n;
    st.pool = None;
    Ok(())
}

/// The size the library's pool has (or will have when first used).
pub fn num_threads() -> usize {
    let st = state();
    match &st.pool {
        Some(p) => p.current_num_threads(),
        None => wanted_threads(st.requested),
    }
}

fn wanted_threads(requested: usize) -> usize {
    if requested > 0 {
        return requested;
    }
    if let Some(n) = std::env::var("PA_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| (1..=MAX_THREADS).contains(&n))
    {
        return n;
    }
    affinity::process_cpus()
        .map(|c| c.len())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The library's pool, built on first use; `None` when threads cannot be started (the call
/// then runs on the calling thread).
fn library_pool() -> Option<Arc<rayon::ThreadPool>> {
    let mut st = state();
    if st.pool.is_none() {
        let cpus = affinity::process_cpus();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(wanted_threads(st.requested))
            .thread_name(|i| format!("pa-worker-{i}"))
            .start_handler(move |_| {
                kind::mark_pool_worker();
                if let Some(c) = &cpus {
                    affinity::set_current(c);
                }
            })
            .build()
            .ok()?;
        st.pool = Some(Arc::new(pool));
    }
    st.pool.clone()
}

/// The CPUs each worker of the library's pool may run on (building the pool if needed), one
/// list per worker. For tests of the affinity rule: feature `test-hooks` only.
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub fn pool_worker_cpus() -> Vec<Option<Vec<usize>>> {
    match library_pool() {
        Some(p) => p.broadcast(|_| affinity::current()),
        None => vec![],
    }
}

/// CPU affinity on Linux; elsewhere nothing is known and nothing is changed.
pub mod affinity {
    /// The CPUs the calling thread may run on.
    pub fn current() -> Option<Vec<usize>> {
        imp::get(0)
    }

    /// The CPUs of the process: those of the thread that loaded the library (captured at load
    /// time), else those of the main thread.
    pub fn process_cpus() -> Option<Vec<usize>> {
        imp::at_load().or_else(|| imp::get(std::process::id() as i32))
    }

    /// Restricts the calling thread to `cpus` (ignored when the OS refuses).
    pub fn set_current(cpus: &[usize]) {
        imp::set(cpus)
    }

    #[cfg(target_os = "linux")]
    mod imp {
        use std::sync::OnceLock;

        static AT_LOAD: OnceLock<Option<Vec<usize>>> = OnceLock::new();

        extern "C" fn capture() {
            let _ = AT_LOAD.set(get(0));
        }

        /// Runs `capture` when the library is loaded (dlopen or program start), on the loading
        /// thread: usually the host's main thread, before it pins anything.
        #[used]
        #[link_section = ".init_array"]
        static CAPTURE: extern "C" fn() = capture;

        pub fn at_load() -> Option<Vec<usize>> {
            AT_LOAD.get().cloned().flatten()
        }

        pub fn get(tid: i32) -> Option<Vec<usize>> {
            // SAFETY: cpu_set_t is plain data; all zeros is the empty set.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is a writable cpu_set_t of the size passed.
            let r = unsafe {
                libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
            };
            if r != 0 {
                return None;
            }
            let n = 8 * std::mem::size_of::<libc::cpu_set_t>();
            // SAFETY: CPU_ISSET reads `set` at index c < CPU_SETSIZE.
            Some(
                (0..n)
                    .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
                    .collect(),
            )
        }

        pub fn set(cpus: &[usize]) {
            // SAFETY: as in `get`.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            let n = 8 * std::mem::size_of::<libc::cpu_set_t>();
            for &c in cpus.iter().filter(|&&c| c < n) {
                // SAFETY: c < CPU_SETSIZE.
                unsafe { libc::CPU_SET(c, &mut set) };
            }
            // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 is the calling thread.
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        }
    }

    #[cfg(not(target_os = "linux"))]
    mod imp {
        pub fn at_load() -> Option<Vec<usize>> {
            None
        }
        pub fn get(_: i32) -> Option<Vec<usize>> {
            None
        }
        pub fn set(_: &[usize]) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// A parallel-for on fresh scoped threads, one per task (a host pool that is never the
    /// caller), or, with `ctx` non-null, one that skips every task (a broken host).
    unsafe extern "C" fn spawn_for(
        ctx: *mut c_void,
        n: usize,
        task: TaskFn,
        task_ctx: *mut c_void,
    ) {
        if !ctx.is_null() {
            return;
        }
        let task_ctx = task_ctx as usize;
        std::thread::scope(|s| {
            for i in 0..n {
                // SAFETY: the library's task and context, once per i < n.
                s.spawn(move || unsafe { task(task_ctx as *mut c_void, i) });
            }
        });
    }

    fn host(threads: usize, skip: bool) -> Runner {
        Runner::Host(HostRunner {
            parallel_for: spawn_for,
            ctx: if skip {
                std::ptr::NonNull::<c_void>::dangling().as_ptr()
            } else {
                std::ptr::null_mut()
            },
            threads,
        })
    }

    /// Every item of every region of a team runs exactly once, whoever runs it, and a region
    /// starts only after the previous one has finished (its items see all earlier writes).
    #[test]
    fn team_runs_each_item_once_region_after_region() {
        for (threads, skip) in [(2, false), (3, false), (8, false), (4, true)] {
            let counts: Vec<AtomicU32> = (0..500).map(|_| AtomicU32::new(0)).collect();
            let total = host(threads, skip).region(|r| {
                assert!(matches!(r, Runner::Team(_)), "a host region gives a team");
                for region in 0..20u32 {
                    let n = 1 + (region as usize * 37) % 500;
                    r.for_each(n, &|i| {
                        // Every item of the previous region has finished: its count is `region`.
                        assert!(counts[i].load(Ordering::Relaxed) <= region);
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                    for (i, c) in counts.iter().enumerate().take(n) {
                        assert!(
                            c.load(Ordering::Relaxed) >= 1,
                            "item {i} of region {region} lost"
                        );
                    }
                }
                counts
                    .iter()
                    .map(|c| c.load(Ordering::Relaxed))
                    .sum::<u32>()
            });
            let want: u32 = (0..20u32).map(|r| 1 + (r * 37) % 500).sum();
            assert_eq!(
                total, want,
                "{threads} threads (skip {skip}): items run != items"
            );
        }
    }

    /// A panic in an item, or in the body, reaches the caller of `region`; the team's other
    /// threads leave and nothing hangs.
    #[test]
    fn team_passes_panics_to_the_caller() {
        let r = catch_unwind(|| {
            host(3, false).region(|r| {
                r.for_each(100, &|i| {
                    if i == 57 {
                        panic!("item 57");
                    }
                })
            })
        });
        let msg = r.expect_err("item panic lost");
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"item 57"));
        let r = catch_unwind(|| host(2, false).region(|_| -> () { panic!("body") }));
        assert_eq!(
            r.expect_err("body panic lost").downcast_ref::<&str>(),
            Some(&"body")
        );
    }
}
