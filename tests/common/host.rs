//! A host's parallel-for for the runner tests: fresh scoped threads, one per task (like a host
//! pool, never the calling thread), recording how many regions it was asked for and the thread
//! of each task call.

use super::call::Call;
use paged_attention::threads::{HostRunner, Runner, TaskFn};
use std::ffi::c_void;
use std::sync::Mutex;
use std::thread::ThreadId;

/// What the host's parallel-for saw.
#[derive(Default)]
pub struct Host {
    task_threads: Mutex<Vec<ThreadId>>,
    regions: Mutex<usize>,
}

impl Host {
    /// A runner whose parallel-for is this host's, with `threads` threads; `self` must outlive
    /// every call made with it.
    pub fn runner(&self, threads: usize) -> Runner {
        Runner::Host(HostRunner {
            parallel_for: spawn_parallel_for,
            ctx: self as *const Host as *mut c_void,
            threads,
        })
    }

    /// How many regions the parallel-for was asked for so far.
    pub fn regions(&self) -> usize {
        *self.regions.lock().unwrap()
    }

    /// The thread of each task call so far, in the order they started.
    pub fn task_threads(&self) -> Vec<ThreadId> {
        self.task_threads.lock().unwrap().clone()
    }
}

/// A parallel-for on fresh scoped threads, one per task.
unsafe extern "C" fn spawn_parallel_for(
    ctx: *mut c_void,
    n: usize,
    task: TaskFn,
    task_ctx: *mut c_void,
) {
    // SAFETY: ctx is the &Host that `Host::runner` put in the runner; it outlives every call.
    let host = unsafe { &*(ctx as *const Host) };
    *host.regions.lock().unwrap() += 1;
    let task_ctx = task_ctx as usize;
    std::thread::scope(|s| {
        for i in 0..n {
            s.spawn(move || {
                host.task_threads
                    .lock()
                    .unwrap()
                    .push(std::thread::current().id());
                // SAFETY: the library's task and context, called once per i < n as required.
                unsafe { task(task_ctx as *mut c_void, i) };
            });
        }
    });
}

/// `call` run on a copy through the Rust API on `runner`.
pub fn run_on(call: &Call, runner: Runner) -> Call {
    let mut c = call.clone();
    c.with_api(|i, mut o| paged_attention::execute_on(runner, &mut i.unwrap(), &mut o))
        .expect("valid call");
    c
}
