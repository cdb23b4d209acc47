"""`pa serve`'s /metrics as routers and Prometheus read it: the exposition passes `promtool check
metrics` (Debian's `prometheus` package; scripts/setup.sh installs it); its figures follow from the
requests sent (finish reasons, token counts, the latency histograms' counts, prefix-cache queries
and hits, KV-cache use while a request runs); `--metric-names vllm` spells vLLM's names; and a real
Prometheus server scrapes two replicas and answers for the queue and KV-utilisation series of both.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

import model_dir
import tiny_llm

from serve_proc import NAME, Metrics, Server, free_port

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NEEDS = "Debian's prometheus package (promtool, prometheus): scripts/setup.sh installs it"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir.write_model_dir(tmp_path_factory.mktemp("metrics") / "gqa4", tiny_llm.VARIANTS["gqa4"])


def promtool(text):
    assert PROMTOOL, NEEDS
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    return p.returncode, (p.stdout + p.stderr).strip()


def complete(url, prompt, max_tokens, **extra):
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def stream_in_background(url, max_tokens):
    """A long streaming request; returns (thread, started event)."""
    started = threading.Event()

    def run():
        body = {"model": NAME, "prompt": "a long one " * 8, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                started.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(60), "the stream never started"
    return t


def test_figures_follow_the_requests_and_promtool_accepts_them(model):
    s = Server(model, "--block-size", "16")
    try:
        m0 = s.metrics()
        assert m0.labels("pa_num_requests_waiting") == [{"model_name": NAME}]
        info = m0.labels("pa_cache_config_info")[0]
        assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) == m0["pa_kv_blocks"] > 0, info
        # 3 requests of 5 tokens each, ignoring the end of sequence: 3 "length" ends.
        prompt = "the river and the garden and the quiet city light over the hills " * 3
        usage = [complete(s.url, prompt, 5, ignore_eos=True)["usage"] for _ in range(3)]
        m = s.metrics()
        assert m.value("pa_request_success_total", finished_reason="length") == 3
        assert m.value("pa_request_success_total", finished_reason="stop") == 0
        assert m["pa_generation_tokens_total"] == 15
        assert m["pa_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usage)
        assert m["pa_time_to_first_token_seconds_count"] == 3
        assert m["pa_e2e_request_latency_seconds_count"] == 3
        assert m["pa_inter_token_latency_seconds_count"] == 3 * 4, "4 gaps between 5 tokens, 3 times"
        assert m.value("pa_e2e_request_latency_seconds_bucket", le="+Inf") == 3
        # The same prompt thrice, one after the other: the second and third find its full blocks.
        n = usage[0]["prompt_tokens"]
        assert m["pa_prefix_cache_queries_total"] == 3 * n
        assert m["pa_prefix_cache_hits_total"] == 2 * ((n - 1) // 16 * 16), (n, m["pa_prefix_cache_hits_total"])
        assert m["pa_num_preemptions_total"] == 0
        # While a request runs, the cache is in use and the usage is the block fraction.
        t = stream_in_background(s.url, 200)
        busy = s.metrics()
        assert busy["pa_num_requests_running"] == 1 and busy["pa_requests_in_flight"] == 1
        assert 0 < busy["pa_kv_cache_usage_perc"] <= 1
        assert busy["pa_kv_cache_usage_perc"] == pytest.approx(busy["pa_kv_blocks_used"] / busy["pa_kv_blocks"])
        code, out = promtool(busy.text)
        assert code == 0, out
        t.join(120)
        idle = s.metrics()
        assert idle["pa_kv_cache_usage_perc"] == 0 and idle["pa_num_requests_running"] == 0
        code, out = promtool(idle.text)
        assert code == 0, out
    finally:
        s.stop()


def test_vllm_names_are_vllm_spelled_and_promtool_objects_only_to_the_colon(model):
    s = Server(model, "--metric-names", "vllm")
    try:
        complete(s.url, "Hello world", 3)
        m = s.metrics()
    finally:
        s.stop()
    for name in ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "pa_kv_blocks", "pa_engine_steps_total"]:
        assert m.labels(name), f"{name} missing"
    assert m["vllm:e2e_request_latency_seconds_count"] == 1
    assert not [n for n, _, _ in m.samples if n.startswith("pa_num_") or n.startswith("vllm:kv_blocks")]
    code, out = promtool(m.text)
    problems = [line for line in out.splitlines() if line]
    assert code != 0 and problems, "promtool refuses ':' in names; did it change?"
    assert all(p.endswith("metric names should not contain ':'") for p in problems), problems


def test_prometheus_scrapes_two_replicas(model, tmp_path):
    assert PROMETHEUS, NEEDS
    a, b = Server(model), Server(model)
    port = free_port()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: pa
    static_configs:
      - targets: ["127.0.0.1:{a.port}", "127.0.0.1:{b.port}"]
""")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(q):
        try:
            r = httpx.get(api, params={"query": q}, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}
        assert r["status"] == "success", r
        return {x["metric"]["instance"]: (x["metric"], float(x["value"][1])) for x in r["data"]["result"]}

    def wait_for(q, ok, what):
        deadline = time.time() + 60
        while True:
            got = query(q)
            if ok(got):
                return got
            assert prom.poll() is None, prom.stderr.read()
            assert time.time() < deadline, f"{what}: {got}"
            time.sleep(0.3)

    try:
        targets = {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
        wait_for("up", lambda g: set(g) == targets and all(v == 1 for _, v in g.values()), "both targets up")
        for q in ["pa_num_requests_waiting", "pa_num_requests_running", "pa_kv_cache_usage_perc"]:
            got = wait_for(q, lambda g: set(g) == targets, f"{q} of both replicas")
            assert all(labels["model_name"] == NAME for labels, _ in got.values()), got
        # A long request on replica a: Prometheus sees a's cache in use and b's empty.
        t = stream_in_background(a.url, 400)
        ia, ib = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
        got = wait_for("pa_kv_cache_usage_perc", lambda g: g.get(ia, ({}, 0))[1] > 0, "a's cache in use")
        assert got[ib][1] == 0, got
        running = query("pa_num_requests_running")
        assert running[ib][1] == 0, running
        t.join(300)
    finally:
        prom.terminate()
        prom.wait(30)
        a.stop()
        b.stop()


def test_metrics_parser_reads_labels_and_escapes():
    m = Metrics('x_total{model_name="a\\"b",le="+Inf"} 3\nx_total{model_name="c"} 4\ny 1.5e-3\n')
    assert m["x_total"] == 7 and m.value("x_total", model_name='a"b') == 3 and m["y"] == 0.0015
    with pytest.raises(KeyError):
        m.value("x_total", model_name="zz")
