"""Pack the bundled zoo/ weights small enough to travel to a lent GPU machine, and unpack them there.

The device tool copies at most 64 MiB of working tree; zoo/ holds 83 MiB of bf16 safetensors. A bf16
number's high byte (sign and exponent) is highly repetitive and its low byte is not, so each file's
bytes are split into the two planes and only the high plane is compressed (lzma): 83 -> 57 MiB,
bit-exact (unpack checks a sha256 of every file).

    python scripts/gpu/pack_zoo.py pack .gpu/zoo.pack      # here, before a device run
    python scripts/gpu/pack_zoo.py unpack .gpu/zoo.pack    # there, before the benchmark
"""
import hashlib
import json
import lzma
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def pack(out: Path) -> None:
    entries, blobs = [], []
    for f in sorted((ROOT / "zoo").glob("*/model.safetensors")):
        raw = f.read_bytes()
        header_len = 8 + int.from_bytes(raw[:8], "little")
        body = np.frombuffer(raw[header_len:], dtype=np.uint8)
        if body.size % 2:
            raise SystemExit(f"{f}: odd body length; only 2-byte (bf16/fp16) tensors are packed")
        low, high = body.reshape(-1, 2).T  # little-endian: byte 0 is the low byte
        parts = [raw[:header_len], low.tobytes(), lzma.compress(high.tobytes(), preset=6)]
        entries.append({"path": str(f.relative_to(ROOT)), "sizes": [len(p) for p in parts],
                        "sha256": hashlib.sha256(raw).hexdigest()})
        blobs += parts
        print(f"{f.relative_to(ROOT)}: {len(raw) / 2**20:.1f} -> {sum(len(p) for p in parts) / 2**20:.1f} MiB")
    index = json.dumps(entries).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as fh:
        fh.write(len(index).to_bytes(8, "little") + index)
        for b in blobs:
            fh.write(b)


def unpack(src: Path) -> None:
    data = memoryview(src.read_bytes())
    n = int.from_bytes(data[:8], "little")
    entries, pos = json.loads(bytes(data[8 : 8 + n])), 8 + n
    for e in entries:
        parts = []
        for size in e["sizes"]:
            parts.append(bytes(data[pos : pos + size]))
            pos += size
        header, low = parts[0], np.frombuffer(parts[1], np.uint8)
        high = np.frombuffer(lzma.decompress(parts[2]), np.uint8)
        raw = header + np.stack([low, high], 1).tobytes()
        if hashlib.sha256(raw).hexdigest() != e["sha256"]:
            raise SystemExit(f"{e['path']}: checksum mismatch after unpacking")
        (ROOT / e["path"]).write_bytes(raw)
        print(f"unpacked {e['path']}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("pack", "unpack"):
        raise SystemExit(__doc__)
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]))
