"""The deployment recipe, tested with its own files: two `pa serve` replicas pinned to separate cores
behind nginx (deploy/nginx.conf) and behind HAProxy (deploy/haproxy.cfg), their ports rewritten to
free ones. A mixed load (completions and chat, streamed and not, with and without a session
header) runs through the balancer; one replica is killed (SIGKILL) while it has requests in
flight; a request fails only if it was in flight on the killed replica and streaming (a whole
answer is retried on the other replica), and every request sent after the kill succeeds. Session affinity: requests with one X-Session-Id all
reach one replica."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import model_dir
import tiny_llm
from serve_proc import NAME, Server, free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir.write_model_dir(tmp_path_factory.mktemp("failover") / "gqa4", tiny_llm.VARIANTS["gqa4"])


def find(name):
    exe = shutil.which(name) or f"/usr/sbin/{name}"
    assert Path(exe).is_file(), f"{name} missing: scripts/setup.sh installs it"
    return exe


def replicas(model):
    """Two replicas, each pinned to its own core (one core each if the machine has two)."""
    cpus = sorted(os.sched_getaffinity(0))
    pins = [{cpus[0]}, {cpus[-1]}]
    return [Server(model, "--max-queue", "64",
                   preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, cpu)) for cpu in pins]


def balancer(kind, tmp_path, a, b):
    """Starts nginx or HAProxy on deploy/'s file with free ports; returns (process, url)."""
    port = free_port()
    src = (DEPLOY / ("nginx.conf" if kind == "nginx" else "haproxy.cfg")).read_text()
    for old, new in (("127.0.0.1:8001", f"127.0.0.1:{a.port}"), ("127.0.0.1:8002", f"127.0.0.1:{b.port}"),
                     ("127.0.0.1:8000", f"127.0.0.1:{port}")):
        assert old in src, f"{old} not in the {kind} config"
        src = src.replace(old, new)
    conf = tmp_path / f"{kind}.conf"
    conf.write_text(src)
    cmd = ([find("nginx"), "-p", str(tmp_path), "-c", str(conf)] if kind == "nginx"
           else [find("haproxy"), "-db", "-f", str(conf)])
    lb = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 15
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return lb, url
        except httpx.HTTPError:
            pass
        assert lb.poll() is None, lb.stderr.read()
        assert time.time() < deadline, f"{kind} not up"
        time.sleep(0.1)


def request(url, i):
    """Request i of the mixed load; returns True if it got a whole answer."""
    chat, stream = i % 2 == 0, i % 3 == 0
    # 100 to 300 tokens: long enough that requests are still in flight when one replica is killed,
    # even on a quiet machine where the tiny model makes a token in half a millisecond.
    body = {"model": NAME, "max_tokens": 100 + i % 5 * 50, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: tell a story"}]
    else:
        body["prompt"] = f"request {i}: once upon a time"
    headers = {"X-Session-Id": f"user-{i % 4}"} if i % 5 else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if stream:
            with httpx.stream("POST", url + path, json=body, headers=headers, timeout=60) as r:
                if r.status_code != 200:
                    return False
                return "data: [DONE]" in "".join(r.iter_text())
        r = httpx.post(url + path, json=body, headers=headers, timeout=60)
        return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("kind", ["nginx", "haproxy"])
def test_a_killed_replica_loses_only_its_in_flight_requests(kind, model, tmp_path):
    a, b = replicas(model)
    lb = None
    try:
        lb, url = balancer(kind, tmp_path, a, b)
        # Affinity: one session's requests reach one replica.
        before = [s.metrics()["pa_request_success_total"] for s in (a, b)]
        for _ in range(6):
            r = httpx.post(url + "/v1/completions", headers={"X-Session-Id": "sticky"}, timeout=60,
                           json={"model": NAME, "prompt": "same user", "max_tokens": 2})
            assert r.status_code == 200, r.text
        grew = [s.metrics()["pa_request_success_total"] - n for s, n in zip((a, b), before)]
        assert sorted(grew) == [0, 6], f"one session spread over both replicas: {grew}"

        # The load: 48 requests, 6 at a time; replica a is killed once it has requests in flight.
        results, outstanding, at_kill, sent_after_kill = {}, set(), [None], set()
        in_flight_on_a = [0.0]
        kill_at = threading.Event()
        lock = threading.Lock()

        def one(i):
            with lock:
                (sent_after_kill if at_kill[0] is not None else outstanding).add(i)
            ok = request(url, i)
            with lock:
                results[i] = ok
                outstanding.discard(i)
            if i == 12:
                kill_at.set()

        def killer():
            kill_at.wait(60)
            deadline = time.time() + 10
            while time.time() < deadline:
                with lock:
                    in_flight_on_a[0] = a.metrics()["pa_requests_in_flight"]
                    if in_flight_on_a[0] >= 1:
                        # No request starts between the reading and the kill.
                        a.proc.send_signal(signal.SIGKILL)
                        at_kill[0] = set(outstanding)
                        break
                time.sleep(0.002)
            a.proc.wait(10)

        k = threading.Thread(target=killer)
        k.start()
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(48)))
        k.join()
        failed = sorted(i for i, ok in results.items() if not ok)
        print(f"{kind}: {len(failed)} of 48 failed, {in_flight_on_a[0]:.0f} in flight on the killed replica "
              f"and {len(at_kill[0] or ())} through the balancer at the kill, {len(sent_after_kill)} sent after it")
        assert at_kill[0] is not None, "replica a never had a request in flight"
        assert len(sent_after_kill) >= 10, "the load ended before the kill"
        assert not set(failed) - at_kill[0], (
            f"requests not in flight at the kill failed: {sorted(set(failed) - at_kill[0])}")
        # A whole (not streamed) answer has sent nothing before the kill: the balancer retries it.
        assert all(i % 3 == 0 for i in failed), f"requests not streamed failed: {failed}"
        assert len(failed) <= in_flight_on_a[0], (
            f"{len(failed)} requests failed ({failed}); {in_flight_on_a[0]:.0f} were in flight on the killed replica")
        # The survivor carries on alone.
        ok = [request(url, 100 + i) for i in range(6)]
        assert all(ok), ok
    finally:
        if lb is not None:
            lb.terminate()
            lb.wait(10)
        for s in (a, b):
            s.stop()
