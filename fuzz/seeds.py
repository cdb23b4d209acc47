#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora into fuzz/corpus/<target>/ from the golden models in
models/ (IR + weights, .npy inputs, the calls they describe), a few small generated inputs, and
every input in fuzz/regressions/<target>/ (each one found a bug; every run replays them first).
Standard library only, so it runs before any venv exists. Idempotent."""
import ast
import hashlib
import os
import random
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "fuzz", "corpus")
ELEM = {"<f4": 0, "<f2": 1, "<u2": 2, "<i4": 3}


def put(target, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
        f.write(data)


def npy(raw):
    """(descr, shape, data) of a version 1-3 .npy file."""
    major = raw[6]
    hlen, start = (struct.unpack("<H", raw[8:10])[0], 10) if major == 1 else (struct.unpack("<I", raw[8:12])[0], 12)
    head = ast.literal_eval(raw[start:start + hlen].decode("latin1"))
    return head["descr"], tuple(head["shape"]), raw[start + hlen:]


def call_bytes(tensors, flags=1):
    """The execute target's encoding of a call (see fuzz/fuzz_targets/execute.rs)."""
    out = bytes([len(tensors) - 9, flags])
    for elem, shape, data in tensors:
        out += bytes([elem, len(shape)]) + b"".join(struct.pack("<q", d) for d in shape) + data
    return out


def shapes_bytes(tensors):
    """The infer_shapes target's encoding (elem + 1, rank + 1, one byte per small dim)."""
    out = bytes([len(tensors) - 9])
    for elem, shape, _ in tensors:
        out += bytes([elem + 1, len(shape) + 1]) + bytes(min(d, 23) for d in shape)
    return out


def main():
    models = os.path.join(ROOT, "models")
    for name in sorted(os.listdir(models)):
        d = os.path.join(models, name)
        if not os.path.isdir(d):
            continue
        xml = os.path.join(d, "model.xml")
        if os.path.isfile(xml):
            binp = os.path.join(d, "model.bin")
            weights = open(binp, "rb").read() if os.path.isfile(binp) else b""
            put("ir_xml", open(xml, "rb").read() + b"\0" + weights)
        ins = sorted(
            (int(f.split("_")[1]), f) for f in os.listdir(d) if f.startswith("in_") and f.endswith(".npy")
        )
        tensors = []
        for i, (idx, f) in enumerate(ins):
            raw = open(os.path.join(d, f), "rb").read()
            if len(raw) < 4096:
                put("npy", raw)
            if idx != i:
                break
            descr, shape, data = npy(raw)
            if descr not in ELEM:
                break
            tensors.append((ELEM[descr], shape, data))
        if len(tensors) >= 9:
            total = sum(len(t[2]) for t in tensors)
            if total <= 1 << 20:
                put("execute", call_bytes(tensors))
            put("infer_shapes", shapes_bytes(tensors))
    reg = os.path.join(ROOT, "fuzz", "regressions")
    for target in sorted(os.listdir(reg)) if os.path.isdir(reg) else []:
        for f in sorted(os.listdir(os.path.join(reg, target))):
            put(target, open(os.path.join(reg, target, f), "rb").read())
    rng = random.Random(11)
    for target in ("cache_manager", "scheduler"):
        for n in (8, 32, 128, 512):
            put(target, bytes(rng.randrange(256) for _ in range(n)))


if __name__ == "__main__":
    main()
