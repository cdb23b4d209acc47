"""Read an IR with our extension loaded and write it back with OpenVINO's own `save_model`, so the
IR reader can be tested on what OpenVINO writes (cli/tests/conformance.rs, round trip).

    .venv/bin/python tools/ov_save_roundtrip.py --ext target/release/libpaged_attention_openvino.so \
        IN.xml OUT.xml

OUT.bin is written beside OUT.xml. Weights are saved as they are (no f16 compression).
"""
import argparse

import openvino as ov


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", required=True, help="the extension module (libpaged_attention_openvino.so)")
    ap.add_argument("src", help="IR to read")
    ap.add_argument("dst", help="IR to write")
    args = ap.parse_args()
    core = ov.Core()
    core.add_extension(args.ext)
    model = core.read_model(args.src)
    ov.save_model(model, args.dst, compress_to_fp16=False)
    print(args.dst)


if __name__ == "__main__":
    main()
