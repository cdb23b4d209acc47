//! The library's own pool never inherits the affinity of the thread that made the first call:
//! a host that pins its threads (OpenVINO does by default) would otherwise put every worker on
//! that thread's one core.
//!
//! One test in this binary: the pool is built once per process, by the first call.
//!
//! The workers' CPUs are read with `threads::pool_worker_cpus`, a test hook (feature
//! `test-hooks`, with which scripts/test.sh runs this binary); without it this binary has no
//! tests.
#![cfg(feature = "test-hooks")]

mod common;

use common::call::Call;
use common::ref64::{gen_case, Features, Geometry};
use paged_attention::threads::{affinity, pool_worker_cpus, set_num_threads};
use paged_attention::{ElemType, Runner};

fn run(call: &Call, runner: Runner) -> Call {
    let mut c = call.clone();
    c.with_api(|i, mut o| paged_attention::execute_on(runner, &mut i.unwrap(), &mut o))
        .expect("valid call");
    c
}

#[test]
fn first_call_from_a_pinned_thread_leaves_pool_workers_on_the_process_cpus() {
    let process = affinity::process_cpus().expect("sched_getaffinity works on Linux");
    assert!(
        process.len() >= 2,
        "this test needs a process allowed on 2+ CPUs to tell a pinned worker from a free one; it has {process:?}"
    );
    let call = gen_case(
        77,
        &Geometry::new(ElemType::F32, ElemType::F32, 2, 2, 32, 16),
        &Features::default(),
    )
    .to_call();
    let serial = run(&call, Runner::Serial);

    let pinned = std::thread::spawn(move || {
        affinity::set_current(&[process[0]]);
        let me = affinity::current().unwrap();
        assert_eq!(me, vec![process[0]], "could not pin the test thread");
        // The first call into the library's pool happens here, on a one-CPU thread.
        let got = run(&call, Runner::Auto);
        (got, affinity::current().unwrap())
    });
    let (got, still) = pinned.join().unwrap();
    assert!(
        got.snapshot() == serial.snapshot(),
        "pool result differs from serial"
    );
    assert_eq!(
        still.len(),
        1,
        "the library changed the caller's own affinity"
    );

    let process = affinity::process_cpus().unwrap();
    let workers = pool_worker_cpus();
    assert_eq!(
        workers.len(),
        process.len(),
        "pool size is not one worker per process CPU"
    );
    for (i, w) in workers.iter().enumerate() {
        assert_eq!(
            w.as_ref(),
            Some(&process),
            "pool worker {i} runs on {w:?}, not on the process's CPUs"
        );
    }

    // Resizing takes effect at the next use, with the same affinity rule.
    set_num_threads(3).unwrap();
    let workers = pool_worker_cpus();
    assert_eq!(workers.len(), 3);
    assert!(workers.iter().all(|w| w.as_ref() == Some(&process)));
    assert!(
        set_num_threads(1 << 20).is_err(),
        "an absurd thread count is refused"
    );
}
