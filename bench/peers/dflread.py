"""dflread.py: a minimal reader of .dfl streams written from dfl-frame(5) alone (uncompressed and
zstd frames if the `zstandard` module is present), used by the Python peers of the benchmarks and
as an interoperability check of the format. Yields (header_dict, batches) where each batch is a
dict of numpy arrays: seq_lens, input_ids, loss_mask, layers (list of [T, H] arrays).

    python3 dflread.py FILE     # prints one line per batch
"""
import json
import struct
import sys

import numpy as np

MAGIC = b"\x89DFL"
FT_HEADER, FT_TOKENS, FT_HIDDEN, FT_INDEX, FT_END, FT_NOTE = 1, 2, 3, 4, 5, 6
DTYPES = {1: "bfloat16", 2: np.float16, 3: np.float32}
try:
    import xxhash  # optional: verify checksums when present
except ImportError:
    xxhash = None


def _align(n, a=64):
    return (n + a - 1) // a * a


def frames(f):
    """Yields (type, flags, seq, payload bytes) for every frame of a binary file object."""
    while True:
        hdr = f.read(64)
        if not hdr:
            raise ValueError("truncated stream: no END frame")
        if len(hdr) < 64 or hdr[:4] != MAGIC:
            raise ValueError("bad frame header")
        major, flags, ftype = hdr[4], hdr[5], struct.unpack_from("<H", hdr, 6)[0]
        stored, raw, seq = struct.unpack_from("<QQQ", hdr, 8)
        if major != 1:
            raise ValueError("unsupported major version %d" % major)
        pad = (64 - (stored + 8) % 64) % 64
        body = f.read(stored + pad + 8)
        if len(body) < stored + pad + 8:
            raise ValueError("truncated frame")
        if xxhash is not None:
            if xxhash.xxh3_64_intdigest(hdr[:56]) != struct.unpack_from("<Q", hdr, 56)[0]:
                raise ValueError("frame %d: header check mismatch" % seq)
            if xxhash.xxh3_64_intdigest(hdr + body[:-8]) != struct.unpack_from("<Q", body, len(body) - 8)[0]:
                raise ValueError("frame %d: checksum mismatch" % seq)
        payload = body[:stored]
        if flags & 2:
            import zstandard
            payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw)
            width = 2 if flags & 4 else 4 if flags & 8 else 0
            if width:
                a = np.frombuffer(payload, np.uint8).reshape(width, -1)
                payload = a.T.copy().tobytes()
        yield ftype, flags, seq, payload
        if ftype == FT_END:
            return


def _bf16_to_f32(a):
    return (a.astype(np.uint32) << 16).view(np.float32)


def read(path, float32=False):
    f = sys.stdin.buffer if path == "-" else open(path, "rb")
    header = None
    out = []
    for ftype, flags, seq, p in frames(f):
        if ftype == FT_HEADER:
            header = json.loads(p.decode())
        elif ftype in (FT_TOKENS, FT_HIDDEN):
            _, T, S, K, H, dt, _, maxlen = struct.unpack_from("<QQIIIHHI", p, 0)
            off = 64
            seq_lens = np.frombuffer(p, np.uint32, S, off); off += _align(4 * S)
            ids = np.frombuffer(p, np.int32, T, off); off += _align(4 * T)
            mask = np.frombuffer(p, np.uint8, T, off); off += _align(T)
            layers = []
            for _ in range(K):
                if DTYPES[dt] == "bfloat16":
                    a = np.frombuffer(p, np.uint16, T * H, off).reshape(T, H)
                    layers.append(_bf16_to_f32(a) if float32 else a)
                    off += _align(2 * T * H)
                else:
                    dtp = np.dtype(DTYPES[dt])
                    layers.append(np.frombuffer(p, dtp, T * H, off).reshape(T, H))
                    off += _align(dtp.itemsize * T * H)
            out.append(dict(seq_lens=seq_lens, input_ids=ids, loss_mask=mask, layers=layers))
        elif ftype == FT_END:
            n_batches = struct.unpack_from("<Q", p, 0)[0]
            if n_batches != len(out):
                raise ValueError("END says %d batches, read %d" % (n_batches, len(out)))
        elif not flags & 1 and ftype not in (FT_INDEX, FT_NOTE):
            raise ValueError("unknown must-understand frame type %d" % ftype)
    return header, out


if __name__ == "__main__":
    h, batches = read(sys.argv[1])
    print(json.dumps(h))
    for i, b in enumerate(batches):
        print(i, "S=%d T=%d K=%d" % (len(b["seq_lens"]), len(b["input_ids"]), len(b["layers"])))
