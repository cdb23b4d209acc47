//! `pa simulate --chart`: utilization and pool occupancy over time, paged vs contiguous, as a
//! small hand-written SVG. Not plotters: its SVG backend alone builds fast (4 s here), but Cargo
//! has no binary-only dependencies, so it would become a dependency of the library for every
//! user, for one line chart.

use paged_attention_cli::simulate::{SimReport, StepRecord};
use std::fmt::Write;

const W: f64 = 800.0;
const H: f64 = 420.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Points per line at most: steps are averaged into this many bins.
const BINS: usize = 600;

/// `(step, value)` of the steps `f` gives a value for, averaged over `bins` equal ranges of
/// `0..steps` (a bin without values is left out).
fn binned(
    trace: &[StepRecord],
    steps: u64,
    f: impl Fn(&StepRecord) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let bins = BINS.min(steps.max(1) as usize);
    let width = steps.max(1) as f64 / bins as f64;
    let mut sum = vec![(0.0f64, 0usize); bins];
    for t in trace {
        if let Some(v) = f(t) {
            let b = ((t.step as f64 / width) as usize).min(bins - 1);
            sum[b].0 += v;
            sum[b].1 += 1;
        }
    }
    sum.iter()
        .enumerate()
        .filter(|(_, s)| s.1 > 0)
        .map(|(b, s)| ((b as f64 + 0.5) * width, s.0 / s.1 as f64))
        .collect()
}

/// The chart of both runs' per-step records.
pub fn utilization_svg(r: &SimReport) -> String {
    let steps = r.paged.steps.max(r.contiguous.steps).max(1);
    let x = |s: f64| LEFT + s / steps as f64 * (W - LEFT - RIGHT);
    let y = |v: f64| TOP + (1.0 - v.clamp(0.0, 1.0)) * (H - TOP - BOTTOM);
    let mut s = String::new();
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
         viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">KV memory over time: \
         paged vs contiguous ({} requests, {} token slots)</text>\n",
        W / 2.0,
        r.config.num_requests,
        r.config.num_blocks * r.config.block_size
    );
    for k in 0..=5 {
        let v = k as f64 / 5.0;
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{4}%</text>",
            y(v),
            W - RIGHT,
            LEFT - 6.0,
            y(v) + 4.0,
            k * 20
        );
    }
    for k in 0..=5 {
        let st = (steps as f64 * k as f64 / 5.0).round();
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{st}</text>",
            x(st),
            H - BOTTOM + 18.0
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">step (one op call)</text>\n\
         <rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#444\"/>",
        (LEFT + W - RIGHT) / 2.0,
        H - 12.0,
        W - LEFT - RIGHT,
        H - TOP - BOTTOM
    );
    let lines: [(&str, &[StepRecord], u64, bool, &str); 4] = [
        (
            "paged utilization",
            &r.paged.trace,
            r.paged.steps,
            true,
            "#1f77b4",
        ),
        (
            "contiguous utilization",
            &r.contiguous.trace,
            r.contiguous.steps,
            true,
            "#d62728",
        ),
        (
            "paged occupancy",
            &r.paged.trace,
            r.paged.steps,
            false,
            "#1f77b4",
        ),
        (
            "contiguous occupancy",
            &r.contiguous.trace,
            r.contiguous.steps,
            false,
            "#d62728",
        ),
    ];
    for (k, (name, trace, run_steps, util, color)) in lines.iter().enumerate() {
        let pts = if *util {
            binned(trace, *run_steps, StepRecord::utilization)
        } else {
            binned(trace, *run_steps, |t| Some(t.occupancy()))
        };
        let dash = if *util {
            ""
        } else {
            " stroke-dasharray=\"5,3\""
        };
        let path: Vec<String> = pts
            .iter()
            // The run's own step range, scaled: bins are over its steps, the axis over the longer.
            .map(|(st, v)| format!("{:.1},{:.1}", x(*st), y(*v)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\"{dash} points=\"{}\"/>",
            path.join(" ")
        );
        let ly = TOP + 14.0 + 16.0 * k as f64;
        let lx = W - RIGHT - 210.0;
        let _ = writeln!(
            s,
            "<line x1=\"{lx}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>\
             <text x=\"{}\" y=\"{}\">{name}</text>",
            lx + 24.0,
            lx + 30.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}
