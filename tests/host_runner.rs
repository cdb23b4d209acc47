//! A host's parallel-for runs the work: every item runs inside the host's tasks (none on the
//! library's pool, none on the calling thread), and results are bit-identical to a run on the
//! calling thread alone, to the library's pool, and across the host's thread counts.
//!
//! Where each item ran is read from the item counters of the feature `test-hooks` (scripts/test.sh
//! runs this binary with it); without the feature the test still checks the results and the
//! threads of the host's tasks. One test in this binary: the item counters are per process, so
//! nothing else may run here.

mod common;

use common::host::{run_on as run, Host};
use common::ref64::{gen_case, Features, Geometry, SeqKind};
#[cfg(feature = "test-hooks")]
use paged_attention::threads::item_counts;
use paged_attention::threads::{HostRunner, Runner, TaskFn};
use paged_attention::ElemType;
use std::collections::HashSet;
use std::ffi::c_void;

/// A parallel-for that runs every task on the calling thread, in order.
unsafe extern "C" fn sequential_parallel_for(
    _: *mut c_void,
    n: usize,
    task: TaskFn,
    task_ctx: *mut c_void,
) {
    for i in 0..n {
        // SAFETY: the library's task and context, called once per i < n as required.
        unsafe { task(task_ctx, i) };
    }
}

#[test]
fn host_runner_runs_every_item_on_its_threads_with_identical_results() {
    let mut geo = Geometry::new(ElemType::F32, ElemType::F16, 2, 4, 64, 16);
    geo.max_new = 70;
    geo.max_past = 300;
    let seqs = vec![
        SeqKind::Prefill,
        SeqKind::ChunkedPrefill,
        SeqKind::Decode,
        SeqKind::Empty,
        SeqKind::Decode,
    ];
    let f = Features {
        seqs: Some(seqs),
        rotation: Some(true),
        alibi: Some(true),
        ..Features::default()
    };
    let call = gen_case(4242, &geo, &f).to_call();
    let serial = run(&call, Runner::Serial);

    let caller = std::thread::current().id();
    for threads in [1, 2, 3, 8] {
        let host = Host::default();
        let runner = host.runner(threads);
        #[cfg(feature = "test-hooks")]
        let before = item_counts();
        let got = run(&call, runner);
        assert!(
            got.snapshot() == serial.snapshot(),
            "{threads} host threads: results differ from the calling thread's run"
        );
        #[cfg(feature = "test-hooks")]
        {
            let after = item_counts();
            assert!(
                after.host > before.host,
                "{threads} host threads: no item ran in a host task"
            );
            assert_eq!(
                after.pool, before.pool,
                "{threads} host threads: items ran on the library's pool"
            );
            assert_eq!(
                after.other, before.other,
                "{threads} host threads: items ran on the calling thread"
            );
        }
        let seen = host.task_threads();
        assert!(!seen.contains(&caller), "a task ran on the calling thread");
        let distinct: HashSet<_> = seen.iter().collect();
        let regions = host.regions();
        // With more than one thread, the whole call is one region of the host's
        // parallel-for (a team); with one, each region of the kernels is its own.
        if threads > 1 {
            assert_eq!(
                regions, 1,
                "{threads} host threads: one team region per call"
            );
            assert_eq!(seen.len(), threads, "every thread of the team got a task");
        } else {
            assert!(
                regions >= 3,
                "expected insert, attention, merge and scores regions, saw {regions}"
            );
        }
        assert!(
            seen.len() <= regions * threads && distinct.len() == seen.len(),
            "{threads} host threads: more tasks than max_threads per region ({} in {regions})",
            seen.len()
        );
    }

    // A host whose parallel-for runs its tasks one after another on one thread (allowed by
    // the contract): the first task drives the whole call, the others find it done.
    let sequential = Runner::Host(HostRunner {
        parallel_for: sequential_parallel_for,
        ctx: std::ptr::null_mut(),
        threads: 4,
    });
    let got = run(&call, sequential);
    assert!(
        got.snapshot() == serial.snapshot(),
        "sequential host tasks: results differ"
    );

    // The library's own pool and the caller's rayon pool give the same bits.
    let pool = run(&call, Runner::Auto);
    assert!(
        pool.snapshot() == serial.snapshot(),
        "library pool differs from serial"
    );
    let rayon3 = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let inside = rayon3.install(|| run(&call, Runner::Auto));
    assert!(
        inside.snapshot() == serial.snapshot(),
        "caller's rayon pool differs from serial"
    );
}
