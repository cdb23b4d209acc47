"""tools/bench_engine.py's batch-1 summary (``pooled_lines``): a serial workload's tokens/s over
all its prompts, per repetition, from rows in the shape the benchmark records. Runs no engine;
the expected figures are worked out by hand."""
import bench_engine


def run(engine, rep, generated, wall_s):
    return {"engine": engine, "rep": rep, "metrics": {"generated": generated, "wall_s": wall_s}}


def row(workload, cache, runs):
    return {"workload": workload, "cache": cache, "prompt_lens": [100], "runs": runs}


def test_tokens_over_all_prompts_wall_time_per_repetition():
    # Two prompts, two repetitions. Ours: rep 0 (100 + 300) / (1 + 3) = 100 tok/s, rep 1
    # 400 / 5 = 80. GenAI: rep 0 400 / 5 = 80, rep 1 400 / 8 = 50. Ratios 1.25 and 1.6.
    rows = [
        row("grounded1", "f32", [run("ours", 0, 100, 1.0), run("genai", 0, 100, 2.0),
                                 run("ours", 1, 100, 2.0), run("genai", 1, 100, 4.0)]),
        row("grounded1", "f32", [run("ours", 0, 300, 3.0), run("genai", 0, 300, 3.0),
                                 run("ours", 1, 300, 3.0), run("genai", 1, 300, 4.0)]),
    ]
    lines = bench_engine.pooled_lines(rows, ["ours", "genai"], 2, {"grounded1"})
    assert lines == [
        "grounded1 f32, 2 prompts at batch 1, ours: 90.0 tok/s (repetitions 100.0, 80.0); "
        "/ GenAI per repetition 1.250, 1.600, median 1.425",
        "grounded1 f32, 2 prompts at batch 1, genai: 65.0 tok/s (repetitions 80.0, 50.0)",
    ]


def test_only_serial_workloads_and_complete_repetitions_count():
    both = [run("ours", 0, 10, 1.0), run("genai", 0, 10, 1.0)]
    # Two cache types of a concurrent workload are not prompts of a batch-1 one.
    assert bench_engine.pooled_lines([row("attn", "u8", both), row("attn", "f32", both)],
                                     ["ours", "genai"], 1, {"grounded1"}) == []
    # One prompt alone has no summary; per cache type, so one prompt each here.
    assert bench_engine.pooled_lines([row("grounded1", "u8", both), row("grounded1", "f32", both)],
                                     ["ours", "genai"], 1, {"grounded1"}) == []
    # A repetition with a failed run (no metrics) is left out, not counted as zero.
    failed = {"engine": "ours", "rep": 1, "error": "exit 1"}
    rows = [row("grounded1", "f32", both + [failed, run("genai", 1, 10, 1.0)]),
            row("grounded1", "f32", both + [run("ours", 1, 10, 1.0), run("genai", 1, 10, 1.0)])]
    lines = bench_engine.pooled_lines(rows, ["ours", "genai"], 2, {"grounded1"})
    assert lines[0] == ("grounded1 f32, 2 prompts at batch 1, ours: 10.0 tok/s (repetitions 10.0); "
                        "/ GenAI per repetition 1.000, median 1.000")
