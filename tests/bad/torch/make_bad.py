#!/usr/bin/env python3
"""make_bad.py [OUTDIR]: writes the corpus of bad torch.save files and EXPECT, the list of
"file<TAB>error code name<TAB>message substring" that tests/unit/test-torchfile.c and
tests/bats/ckpt.bats check: every file must be rejected with that code (exit status 2) and a
message containing that text. Nothing here can execute anything: the reader never calls what a
pickle names; the malicious pickles are there to prove it refuses them.

Hand-written pickles use the raw opcodes; structural cases reuse the torch stand-ins of
tests/fixtures/torch/make_torch_like.py. Deterministic: same bytes every run."""
import collections
import io
import os
import struct
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(HERE, "..", "..", "fixtures", "torch"))
import make_torch_like as tl  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else HERE
EXPECT = []


def zip_of(path, entries, prefix="archive"):
    with open(path, "wb") as fh:
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
            for name, data in entries:  # names are under prefix/ unless they start with '='
                tl.write_entry(zf, name[1:] if name.startswith("=") else prefix + "/" + name, data)


def bad(name, code, text, pkl=None, entries=None, raw=None):
    path = os.path.join(OUT, name)
    if raw is not None:
        with open(path, "wb") as fh:
            fh.write(raw)
    else:
        ents = [("data.pkl", pkl)] if pkl is not None else []
        zip_of(path, ents + (entries or []))
    EXPECT.append((name, code, text))


def u32(n):
    return struct.pack("<I", n)


def s(text):
    b = text.encode()
    return b"X" + u32(len(b)) + b


PROTO2 = b"\x80\x02"
OD = b"ccollections\nOrderedDict\n)R"     # OrderedDict()
V2 = b"ctorch._utils\n_rebuild_tensor_v2\n"


def tensor_pkl(storage_cls=b"FloatStorage", key="0", numel=4, offset=0, size=(4,), stride=(1,),
               nargs=6):
    """A one-tensor state dict {'w': tensor} as raw opcodes, for records a real writer would never
    produce (the values go straight in)."""
    def tup(vals):
        return b"(" + b"".join(b"J" + struct.pack("<i", v) for v in vals) + b"t"
    pid = b"(" + s("storage") + b"ctorch\n" + storage_cls + b"\n" + s(key) + s("cpu") + \
        b"J" + struct.pack("<i", numel) + b"tQ"
    args = pid + b"J" + struct.pack("<i", offset) + tup(size) + tup(stride) + b"\x89" + OD
    if nargs == 3:
        args = pid + b"J" + struct.pack("<i", offset) + tup(size)
    return PROTO2 + OD + s("w") + V2 + b"(" + args + b"tR" + b"s."


F32x4 = struct.pack("<4f", 1, 2, 3, 4)


def main():
    os.makedirs(OUT, exist_ok=True)
    # --- refused names and calls
    bad("os_system.pt", "data", "refusing the global os.system",
        PROTO2 + b"cos\nsystem\n" + s("echo pwned") + b"\x85R.")
    bad("builtins_eval.pt", "data", "refusing the global builtins.eval",
        PROTO2 + b"cbuiltins\neval\n" + s("1+1") + b"\x85R.")
    bad("stack_global_posix.pt", "data", "refusing the global posix.system",
        b"\x80\x04" + b"\x8c\x05posix\x8c\x06system\x93" + b"\x8c\x02id\x85R.")
    bad("reduce_storage.pt", "data", "refusing to call torch.FloatStorage",
        PROTO2 + b"ctorch\nFloatStorage\n)R.")
    bad("reduce_dict.pt", "data", "REDUCE on a dict", PROTO2 + b"})R.")
    bad("complex_storage.pt", "unsupported", "ComplexFloatStorage",
        tensor_pkl(storage_cls=b"ComplexFloatStorage"), [("data/0", F32x4 * 2)])
    bad("rebuild_args.pt", "data", "_rebuild_tensor_v2 takes 6 or 7 arguments",
        tensor_pkl(nargs=3), [("data/0", F32x4)])
    bad("bad_persid.pt", "data", "persistent id is not a 5-tuple",
        PROTO2 + s("storage") + b"Q.")
    # --- opcodes and interpreter limits
    bad("opcode_inst.pt", "unsupported", "unsupported pickle opcode 'i'",
        PROTO2 + b"(ios\nsystem\n.")
    bad("opcode_unknown.pt", "unsupported", "unsupported pickle opcode", PROTO2 + b"\xf0.")
    bad("memo_range.pt", "data", "memo index 5 was never stored", PROTO2 + b"h\x05.")
    bad("memo_put_huge.pt", "data", "memo index 4294967295 out of range",
        PROTO2 + b"Nr\xff\xff\xff\xff.")
    bad("stack_underflow.pt", "data", "stack underflow", PROTO2 + b"\x86.")
    bad("setitem_underflow.pt", "data", "stack underflow", PROTO2 + b"}N" + b"s.")
    bad("append_to_int.pt", "data", "APPEND to a int", PROTO2 + b"K\x01Na.")
    bad("mark_flood.pt", "data", "nested MARKs", PROTO2 + b"(" * 2000 + b".")
    bad("deep_nesting.pt", "data", "nesting deeper than 64",
        PROTO2 + b"]" * 200 + b"a" * 199 + b".")
    bad("cycle.pt", "data", "nesting deeper than 64", PROTO2 + b"]q\x00h\x00a.")
    # a DAG of 2^40 paths: x0 = [], x_{i+1} = [x_i, x_i]
    dag = PROTO2 + b"]q\x00"
    for i in range(40):
        dag += b"]q" + bytes([i + 1]) + b"(h" + bytes([i]) + b"h" + bytes([i]) + b"e"
    bad("shared_dag.pt", "data", "more than 1048576 nodes", dag + b".")
    bad("no_stop.pt", "truncated", "the pickle ends without STOP", PROTO2 + b"}")
    bad("string_past_end.pt", "truncated", "runs past the end",
        PROTO2 + b"X\xff\xff\xff\x7fabc.")
    bad("proto_9.pt", "unsupported", "pickle protocol 9", b"\x80\x09}.")
    bad("long_int.pt", "unsupported", "integer of 9 bytes", PROTO2 + b"\x8a\x09" + b"\x01" * 9 + b".")
    # --- tensor records against their storages
    bad("storage_missing.pt", "data", "storage '7' is missing",
        tensor_pkl(key="7"), [("data/0", F32x4)])
    bad("offset_past.pt", "data", "lies outside storage '0'",
        tensor_pkl(offset=2), [("data/0", F32x4)])
    bad("stride_past.pt", "data", "lies outside storage '0'",
        tensor_pkl(size=(2, 2), stride=(3, 1)), [("data/0", F32x4)])
    bad("negative_dim.pt", "data", "negative size -1",
        tensor_pkl(size=(-1,)), [("data/0", F32x4)])
    bad("too_many_dims.pt", "unsupported", "9 dimensions",
        tensor_pkl(size=(1,) * 9, stride=(1,) * 9), [("data/0", F32x4)])
    bad("size_mismatch.pt", "data", "has 16 bytes, its record says 5 x f32 = 20",
        tensor_pkl(numel=5), [("data/0", F32x4)])
    bad("huge_numel.pt", "data", "larger than the file",
        tensor_pkl(numel=0x7FFFFFFF, size=(4,)), [("data/0", F32x4)])
    bad("bad_key.pt", "data", "bad storage key",
        tensor_pkl(key="../x"), [("data/0", F32x4)])
    bad("expanded.pt", "unsupported", "overlapping view",
        tensor_pkl(numel=1, size=(64, 64), stride=(0, 0)), [("data/0", F32x4[:4])])
    bad("dup_name.pt", "data", "two tensors are named 'a.b'", dup_name_pkl(), [("data/0", F32x4)])
    # --- the zip
    good = open(os.path.join(HERE, "..", "..", "fixtures", "torch", "state_dict.pt"), "rb").read()
    bad("truncated.pt", "data", "corrupt or truncated zip", raw=good[: len(good) // 2])
    bad("truncated_head.pt", "data", "corrupt or truncated zip", raw=good[:100])
    flipped = bytearray(good)
    z = zipfile.ZipFile(io.BytesIO(good))
    info = z.getinfo("archive/data/0")
    data_at = info.header_offset + 30 + len(info.filename) + len(info.extra)
    flipped[data_at] ^= 0x01
    bad("bad_crc.pt", "data", "corrupt or truncated zip", raw=bytes(flipped))
    bad("no_datapkl.pt", "data", "without <prefix>/data.pkl", entries=[("data/0", F32x4)])
    bad("two_datapkl.pt", "data", "two pickles",
        entries=[("=a/data.pkl", PROTO2 + b"}."), ("=b/data.pkl", PROTO2 + b"}.")])
    bad("big_endian.pt", "unsupported", "only little-endian",
        PROTO2 + b"}.", [("byteorder", b"big")])
    with open(os.path.join(OUT, "dup_entry.pt"), "wb") as fh:
        import warnings
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
            tl.write_entry(zf, "archive/data.pkl", PROTO2 + b"}.")
            tl.write_entry(zf, "archive/data.pkl", PROTO2 + b"}.")
    EXPECT.append(("dup_entry.pt", "data", "two entries named"))
    # a storage deflated to a few bytes that claims more than the whole file (a zip bomb)
    with open(os.path.join(OUT, "zip_bomb.pt"), "wb") as fh:
        with zipfile.ZipFile(fh, "w") as zf:
            tl.write_entry(zf, "archive/data.pkl", tensor_pkl(numel=1 << 20, size=(4,)))
            info = zipfile.ZipInfo("archive/data/0", date_time=tl.FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, bytes(4 << 20))
    EXPECT.append(("zip_bomb.pt", "data", "larger than the file"))
    # --- not a zip at all
    legacy = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03."
    bad("legacy.pt", "unsupported", "legacy torch.save format is not supported; re-save with torch>=1.6",
        raw=legacy)
    bad("not_zip.pt", "data", "not a torch.save file", raw=b"hello, this is text\n")
    bad("empty.pt", "truncated", "truncated: empty input", raw=b"")
    with open(os.path.join(OUT, "EXPECT"), "w") as fh:
        fh.write("# file\tcode\tmessage substring (written by make_bad.py)\n")
        for name, code, text in EXPECT:
            fh.write("%s\t%s\t%s\n" % (name, code, text))


def dup_name_pkl():
    """{'a.b': t, 'a': {'b': t}}: two paths that join to the same name."""
    one = tensor_pkl()
    body = one[len(PROTO2 + OD + s("w")):-2]   # the tensor expression alone
    return PROTO2 + b"}(" + s("a.b") + body + s("a") + b"}" + s("b") + body + b"su."


if __name__ == "__main__":
    main()
