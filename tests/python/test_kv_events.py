"""`pa serve --kv-events-endpoint`: a ZeroMQ subscriber (pyzmq) decodes every message (msgpack) as
vLLM's KVEventBatch during a run with prefix sharing, eviction of cached blocks and preemption on a
small cache; replaying the events gives exactly the server's cached block set
(GET /debug/kv-cache-blocks) at 10 checkpoints, some taken while requests run. The sequence numbers
run without a gap from 0, the first batch is AllBlocksCleared, and so is the last one at exit."""
from __future__ import annotations

import threading
import time

import httpx
import msgpack
import pytest
import zmq

import model_dir
import tiny_llm

from serve_proc import NAME, Server, free_port

BS = 16
TOPIC = "kv@pod-a@tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir.write_model_dir(tmp_path_factory.mktemp("kv_events") / "gqa4", tiny_llm.VARIANTS["gqa4"])


class Subscriber:
    """Replays the events into a set of block hashes, checking each message on the way."""

    def __init__(self, port, shape):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.shape = shape
        self.blocks = set()
        self.seq = -1
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def event(self, e):
        """(tag, fields) of an event in either shape."""
        if self.shape == "array":
            assert isinstance(e, list), e
            tag = e[0]
            names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                     "medium", "lora_name"],
                     "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}[tag]
            assert len(e) == 1 + len(names), e
            return tag, dict(zip(names, e[1:]))
        assert isinstance(e, dict), e
        return e["type"], e

    def poll(self):
        try:
            topic, seq, payload = self.sock.recv_multipart()
        except zmq.Again:
            return False
        assert topic.decode() == TOPIC
        assert len(seq) == 8
        n = int.from_bytes(seq, "big")
        assert n == self.seq + 1, f"batch {n} after {self.seq}: a gap"
        self.seq = n
        ts, events, rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 120 and rank == 0
        assert events, "no empty batches"
        for e in events:
            tag, f = self.event(e)
            self.counts[tag] += 1
            if tag == "BlockStored":
                hashes = f["block_hashes"]
                assert f["block_size"] == BS and len(f["token_ids"]) == BS * len(hashes), f
                assert f["parent_block_hash"] is None or isinstance(f["parent_block_hash"], int)
                assert f["lora_id"] is None and f["medium"] is None
                for h in hashes:
                    assert isinstance(h, int) and 0 <= h < 2 ** 64
                    assert h not in self.blocks, f"{h} stored twice"
                    self.blocks.add(h)
            elif tag == "BlockRemoved":
                for h in f["block_hashes"]:
                    assert h in self.blocks, f"{h} removed but not stored"
                    self.blocks.remove(h)
            else:
                assert tag == "AllBlocksCleared", tag
                self.blocks.clear()
        return True

    def until(self, seq, timeout=30):
        deadline = time.time() + timeout
        while self.seq < seq:
            assert time.time() < deadline, f"batch {seq} never came (last {self.seq})"
            self.poll()

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def cached(server):
    r = httpx.get(server.url + "/debug/kv-cache-blocks", timeout=10)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["seq"], set(j["block_hashes"])


def checkpoint(server, sub):
    seq, want = cached(server)
    sub.until(seq)
    assert sub.blocks == want, (len(sub.blocks), len(want), sub.blocks ^ want)
    return len(want)


def run_round(url, prompts, max_tokens):
    def one(p):
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    ts = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in ts:
        t.start()
    return ts


@pytest.mark.parametrize("shape", ["array", "map"])
def test_replayed_events_equal_the_cached_blocks(model, shape):
    port = free_port()
    # 30 blocks of 16 tokens: six 100-token requests cannot all run at once.
    s = Server(model, "--block-size", str(BS), "--kv-events-endpoint", f"tcp://*:{port}",
               "--kv-events-topic", TOPIC, "--kv-events-format", shape, kv_cache_size=0.0005)
    sub = Subscriber(port, shape)
    try:
        m = s.metrics()
        assert m.labels("pa_cache_config_info")[0]["num_gpu_blocks"] == "30"
        # The slow-joiner: wait until the subscription has reached the publisher, by which time
        # batch 0 (AllBlocksCleared, sent at start) has gone; later batches must all arrive.
        time.sleep(0.5)
        assert cached(s) == (0, set())
        assert not sub.poll(), "batch 0 went before the subscriber connected"
        sub.seq = 0
        shared = "the river and the garden and the quiet city light over the hills " * 2
        sizes, checks = [], 0
        rounds = 2 if shape == "map" else 5
        for r in range(rounds):
            prompts = [shared + f"request {r} {i} " * (i + 1) for i in range(6)]
            threads = run_round(s.url, prompts, 100)
            time.sleep(0.4)
            sizes.append(checkpoint(s, sub))  # while they run
            checks += 1
            for t in threads:
                t.join(300)
            sizes.append(checkpoint(s, sub))
            checks += 1
        if shape == "array":
            assert checks == 10
        m = s.metrics()
        assert m["pa_num_preemptions_total"] > 0, "the run was to preempt"
        assert m["pa_prefix_cache_hits_total"] > 0, "the run was to share prefixes"
        assert sub.counts["BlockRemoved"] > 0, "the run was to evict cached blocks"
        assert sub.counts["BlockStored"] > 0 and max(sizes) > 0, sizes
        assert m["pa_kv_events_dropped_total"] == 0
        assert m["pa_kv_events_batches_total"] == sub.seq + 1
    finally:
        s.stop()
        # At exit the server clears its blocks: the last batch is AllBlocksCleared.
        while sub.poll():
            pass
        sub.close()
    assert s.proc.returncode == 0
    assert sub.blocks == set() and sub.counts["AllBlocksCleared"] >= 1


def test_debug_route_is_absent_without_kv_events(model):
    s = Server(model)
    try:
        r = httpx.get(s.url + "/debug/kv-cache-blocks", timeout=10)
        assert r.status_code == 404 and "kv-events-endpoint" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_an_endpoint_in_use_is_a_start_up_error(model, tmp_path):
    import socket
    import subprocess
    from serve_proc import ENGINE, F32
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([str(ENGINE), "serve", str(model), "--port", str(free_port()), *F32,
                            "--kv-events-endpoint", f"tcp://*:{port}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "KV-event socket" in p.stderr and "panicked" not in p.stderr, p.stderr
