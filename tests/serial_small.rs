//! Small calls run on the calling thread: a call whose work (`kernel::fast::call_work`) is
//! below `FastOptions::host_serial_below` never enters the host's parallel-for, one at or above
//! it does, and both give the bits of a run on the calling thread alone.

mod common;

use common::call::Call;
use common::host::{run_on, Host};
use common::ref64::{gen_case, Features, Geometry, SeqKind};
use paged_attention::kernel::fast::{
    call_work, execute_with, FastOptions, HOST_SERIAL_BELOW, SERIAL_BELOW,
};
use paged_attention::threads::Runner;
use paged_attention::ElemType;

/// Runs `call` on a 2-thread host runner with `host_serial_below` (`None`: the default options);
/// returns the result and how many regions the host's parallel-for was asked for.
fn on_host(call: &Call, serial_below: Option<usize>) -> (Call, usize) {
    let host = Host::default();
    let mut opts = FastOptions {
        runner: host.runner(2),
        ..FastOptions::default()
    };
    if let Some(b) = serial_below {
        opts.host_serial_below = b;
        // The pool's threshold never applies to a host's runner.
        opts.serial_below = usize::MAX;
    }
    let mut c = call.clone();
    c.with_api(|i, mut o| execute_with(opts, &mut i.unwrap(), &mut o))
        .expect("valid call");
    (c, host.regions())
}

fn serial(call: &Call) -> Call {
    run_on(call, Runner::Serial)
}

/// SmolLM2's attention shapes (9 query heads, 3 KV heads, head size 64), block 32.
fn smollm2(seqs: Vec<SeqKind>, max_past: usize, max_new: usize, seed: u64) -> Call {
    let mut geo = Geometry::new(ElemType::F32, ElemType::F32, 3, 3, 64, 32);
    geo.max_past = max_past;
    geo.max_new = max_new;
    let f = Features {
        seqs: Some(seqs),
        ..Features::default()
    };
    gen_case(seed, &geo, &f).to_call()
}

/// Around each call's own work: just above it the call runs serially (no host region), at it
/// on the host's threads (one team region); the bits are those of the calling thread alone.
#[test]
fn serial_and_parallel_agree_around_the_threshold() {
    let cases = [
        (vec![SeqKind::Decode], 300, 1),
        (vec![SeqKind::Decode], 2000, 1),
        (vec![SeqKind::ChunkedPrefill], 1000, 5),
        (
            vec![SeqKind::Decode, SeqKind::ChunkedPrefill, SeqKind::Empty],
            700,
            5,
        ),
        (vec![SeqKind::Prefill, SeqKind::Decode], 400, 70),
    ];
    for (seed, (kinds, max_past, max_new)) in cases.into_iter().enumerate() {
        let call = smollm2(kinds, max_past, max_new, 38 + seed as u64);
        let work = call_work(&call.clone().validate().expect("valid plan"));
        assert!(work > 0, "case {seed}: no work counted");
        let alone = serial(&call);
        for (below, want_regions) in [(work + 1, 0), (work, 1), (0, 1)] {
            let (got, regions) = on_host(&call, Some(below));
            assert_eq!(
                regions, want_regions,
                "case {seed} (work {work}), serial_below {below}: host regions"
            );
            assert!(
                got.snapshot() == alone.snapshot(),
                "case {seed} (work {work}), serial_below {below}: results differ from serial"
            );
        }
    }
}

/// The default thresholds: on a host's runner (threads awake) a one-token decode at SmolLM2's
/// shapes over up to 60 keys stays on the calling thread; over 150 keys or more, or a 64-token
/// prefill, it goes to the host's threads. The library's own pool keeps its higher threshold.
#[test]
fn default_threshold_keeps_tiny_decodes_serial() {
    assert_eq!(FastOptions::default().serial_below, SERIAL_BELOW);
    assert_eq!(FastOptions::default().host_serial_below, HOST_SERIAL_BELOW);
    for (kinds, max_past, max_new, serial_wanted) in [
        (vec![SeqKind::Decode], 60, 1, true),
        (vec![SeqKind::Decode], 300, 1, false),
        (vec![SeqKind::Decode; 4], 2000, 1, false),
        (vec![SeqKind::Prefill], 1, 300, false),
    ] {
        // A seed whose random lengths land in the range this case is about.
        let call = (0..64)
            .map(|s| smollm2(kinds.clone(), max_past, max_new, s))
            .find(|c| {
                let plan = c.clone().validate().expect("valid plan");
                let (past, new) = (plan.seqs[0].past, plan.seqs[0].n);
                if serial_wanted {
                    past >= max_past / 2
                } else {
                    past >= max_past / 2 || new >= 64
                }
            })
            .expect("a seed with long enough sequences");
        let (got, regions) = on_host(&call, None);
        assert_eq!(
            regions == 0,
            serial_wanted,
            "{kinds:?} past up to {max_past}: {regions} host regions"
        );
        assert!(got.snapshot() == serial(&call).snapshot());
    }
}
