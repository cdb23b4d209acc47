"""`pa serve` and `pa generate` under abuse: each test states a failure found by an adversarial run,
and fails on a build that has it.

Connections that stall (half-sent heads, bodies that never come) are closed after the read
timeout; SIGTERM ends the process within --shutdown-timeout whatever clients hold open, and the
drain answers new connections with 503 and OpenAI's error JSON; a chat template with huge output
is refused, not run out of memory; duration arguments out of range are usage errors, not panics; a
stream whose client left is aborted even while a stop string holds its text back; megabyte prompts
do not stall other streams (tokenized off the engine thread, and refused before tokenizing when
they cannot fit); every error status has OpenAI's error JSON, and a `top_p` that rounds to 0 is
blamed on `top_p`; `pa generate --n 2` prints both samples."""
from __future__ import annotations

import asyncio
import json
import resource
import signal
import socket
import subprocess
import time

import httpx
import pytest

from test_serve import ENGINE, F32, NAME, Server, _stream, model, server  # noqa: F401 (fixtures)

BODY = {"model": NAME, "prompt": "The river", "max_tokens": 4}


def post(url, body, **kw):
    return httpx.post(url + "/v1/completions", json=body, timeout=30, **kw)


def open_half_sent(port, n):
    """`n` connections that each send part of a request head and then nothing."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks.append(s)
    return socks


def closed_by_server(s, within):
    """True when the server closes `s` (EOF or reset) within `within` seconds."""
    s.settimeout(within)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def error_json(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------ 1, 2, 6: connections

def test_half_sent_heads_and_bodies_are_closed_after_the_read_timeout(model):
    s = Server(model, "--read-timeout", "1")
    try:
        heads = open_half_sent(s.port, 20)
        body = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        t0 = time.time()
        assert all(closed_by_server(h, 5) for h in heads), "a half-sent head held its connection"
        reply = b""
        body.settimeout(5)
        while not reply.endswith(b"}") and time.time() - t0 < 5:
            chunk = body.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
        assert time.time() - t0 < 4
        assert post(s.url, BODY).status_code == 200, "the server goes on"
    finally:
        s.stop()


def test_sigterm_exits_within_the_shutdown_timeout_whatever_clients_hold(model):
    s = Server(model, "--shutdown-timeout", "2")
    socks = open_half_sent(s.port, 3)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    try:
        rc = s.proc.wait(6)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        pytest.fail("pa serve was still running 6 s after SIGTERM with --shutdown-timeout 2")
    finally:
        for x in socks:
            x.close()
    assert rc == 0 and time.time() - t0 < 4


def test_the_drain_answers_new_connections_with_503_error_json(model):
    s = Server(model, "--shutdown-timeout", "30")

    async def run():
        started = asyncio.Event()
        long = asyncio.create_task(_stream(s.url, "long", max_tokens=1500, started=started))
        await asyncio.wait_for(started.wait(), 60)
        s.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(s.url + "/v1/completions", json=BODY)
            h = await c.get(s.url + "/health")
        return r, h, await long

    r, h, text = asyncio.run(run())
    error_json(r, 503)
    error_json(h, 503)
    assert isinstance(text, str), "the stream in flight ended with [DONE]"
    assert s.proc.wait(30) == 0


# ------------------------------------------------------------------------------ 3: chat template

def test_a_chat_template_with_huge_output_is_refused_and_the_server_goes_on(model, tmp_path):
    d = tmp_path / "evil"
    d.mkdir()
    for f in model.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for i in range(100000) %}{{ messages[0].content * 1000 }}{% endfor %}"
    (d / "tokenizer_config.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    # A bound on the process's memory, so a build that renders it all fails fast, not the machine.
    limit = 4 << 30
    s = Server(d, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    try:
        t0 = time.time()
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": NAME, "messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 4})
        error_json(r, 400, "messages")
        assert "chat template" in r.json()["error"]["message"]
        assert time.time() - t0 < 5
        assert post(s.url, BODY).status_code == 200, "the server goes on"
    finally:
        s.stop()


# ------------------------------------------------------------------------------ 4: durations

def test_durations_out_of_range_are_refused_not_panics(model, tmp_path):
    for value in ("1e20", "inf", "-1", "nan"):
        p = subprocess.run([str(ENGINE), "serve", str(model), f"--shutdown-timeout={value}"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "panicked" not in p.stderr, (value, p.returncode, p.stderr)
        assert "--shutdown-timeout" in p.stderr, p.stderr
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"text": "x", "arrival": 1e300}]))
    p = subprocess.run([str(ENGINE), "generate", str(model), "--prompts", str(f), *F32],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "panicked" not in p.stderr, (p.returncode, p.stderr)
    assert "arrival" in p.stderr, p.stderr


# ------------------------------------------------------------------------------ 5: disconnects

def test_a_stream_left_while_a_stop_string_holds_its_text_is_aborted(server):
    before = server.metrics()
    body = {**BODY, "max_tokens": 1800, "ignore_eos": True, "stream": True, "stop": ["\u263a" * 8000]}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            time.sleep(0.3)  # generating, with every piece of text held back: nothing sent yet
    deadline = time.time() + 3
    while True:
        m = server.metrics()
        if m["pa_num_requests_running"] == 0 and m["pa_num_requests_waiting"] == 0:
            break
        assert time.time() < deadline, "the request still runs for a client that left"
        time.sleep(0.05)
    assert m.value("pa_request_success_total", finished_reason="abort") - before.value("pa_request_success_total", finished_reason="abort") == 1
    assert m["pa_generation_tokens_total"] - before["pa_generation_tokens_total"] < 1800


# ------------------------------------------------------------------------------ 7: big prompts

def test_megabyte_prompts_do_not_stall_a_running_stream(server):
    big = {**BODY, "prompt": "word " * 200_000}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            gaps, last = [], None
            body = {**BODY, "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
                hits = None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if hits is None:
                        hits = asyncio.gather(*[c.post(server.url + "/v1/completions", json=big)
                                                for _ in range(6)])
            return gaps, await hits

    gaps, refused = asyncio.run(run())
    for r in refused:
        error_json(r, 400, "prompt")
    # A build that tokenizes on the engine thread stalls 1.4 to 2.9 s here (measured).
    assert max(gaps) < 0.5, f"the stream stalled {max(gaps):.2f} s while megabyte prompts came in"


# ------------------------------------------------------------------------------ 8: error JSON

def test_every_error_status_has_openai_error_json(server):
    error_json(httpx.get(server.url + "/v1/nothing", timeout=10), 404)
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    error_json(r, 405)
    assert "POST" in r.headers.get("allow", "")
    error_json(httpx.delete(server.url + "/health", timeout=10), 405)
    error_json(post(server.url, {**BODY, "top_p": 1e-300}), 400, "top_p")


# ------------------------------------------------------------------------------ generate --n 2

def test_generate_n2_without_json_prints_every_sample(model):
    args = [str(ENGINE), "generate", str(model), "--prompt", "The river", "--n", "2", "--temperature",
            "0.9", "--seed", "3", "--max-new-tokens", "6", "--ignore-eos", *F32]
    js = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=120)
    assert js.returncode == 0, js.stderr
    samples = [x["text"] for x in json.loads(js.stdout)["samples"]]
    assert len(samples) == 2
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"[0.0] {samples[0]}\n[0.1] {samples[1]}\n"
