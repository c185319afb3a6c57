#!/usr/bin/env python3
"""gen.py: writes the known-bad safetensors corpus of this directory and its MANIFEST
(python3 stdlib only; deterministic). Each case is a small file (opened with dfl_st_open) or a
model directory (dfl_st_model_open) that must be rejected; MANIFEST lines are
name<TAB>code<TAB>substring: the error code (EDATA or ETRUNC) and a piece of the message that
names the problem. test-safetensors checks every case and that every entry here is listed."""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
cases = []


def raw(name, blob, code, sub):
    with open(os.path.join(HERE, name), 'wb') as f:
        f.write(blob)
    cases.append((name, code, sub))


def st_bytes(header, data=b'', hlen=None):
    """header: a dict (dumped compactly) or bytes used as is; hlen overrides the length field."""
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(',', ':')).encode()
    n = len(text) if hlen is None else hlen
    return struct.pack('<Q', n) + text + data


def st(name, header, data=b'', code='EDATA', sub='', hlen=None):
    raw(name, st_bytes(header, data, hlen), code, sub)


def good(tensors):
    """[(name, dtype, shape, nbytes)] laid out contiguously -> (header, data)"""
    h, off = {}, 0
    for name, dt, shape, nb in tensors:
        h[name] = {'dtype': dt, 'shape': shape, 'data_offsets': [off, off + nb]}
        off += nb
    return h, bytes(range(256)) * (off // 256) + bytes(range(off % 256))


def f32(name, off, n=2):
    return {'dtype': 'F32', 'shape': [n], 'data_offsets': [off, off + 4 * n]}


def model_dir(name, files, code, sub):
    d = os.path.join(HERE, name)
    os.makedirs(d)
    for fn, content in files.items():
        with open(os.path.join(d, fn), 'wb') as f:
            f.write(content if isinstance(content, bytes) else content.encode())
    cases.append((name, code, sub))


def shard(names):
    h, data = good([(n, 'F32', [2], 8) for n in names])
    return st_bytes(h, data)


def index(wm):
    return json.dumps({'metadata': {'total_size': 8 * len(wm)}, 'weight_map': wm}, indent=2) + '\n'


def main():
    for e in os.listdir(HERE):
        if e in ('gen.py', 'MANIFEST', 'README'):
            continue
        p = os.path.join(HERE, e)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

    # framing
    raw('empty-file.safetensors', b'', 'ETRUNC', 'truncated: empty input')
    raw('trunc-length.safetensors', b'\x10\x00\x00\x00\x00', 'ETRUNC', 'too short for the 8-byte header length')
    st('header-past-eof.safetensors', b'{"a":{"dtype":"F32"', hlen=1000, code='ETRUNC', sub='runs past the end of the file')
    st('header-over-cap.safetensors', b'{}', hlen=(100 << 20) + 1, sub='over the limit')
    st('header-len-max.safetensors', b'{}', hlen=(1 << 64) - 1, sub='over the limit')
    st('header-len-zero.safetensors', b'', hlen=0, sub='too short for a JSON object')
    st('header-invalid-json.safetensors', b'{"a": {"dtype": "F32",  ', sub='invalid JSON')
    st('header-garbage-pad.safetensors', b'{}  xx', sub='invalid JSON')
    st('header-not-object.safetensors', b'[1, 2, 3]', sub='not a JSON object')
    st('header-not-utf8.safetensors', b'{"a\xff\xfe":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}', sub='invalid JSON')
    st('header-nul.safetensors', b'{"a":\x00{}}', sub='NUL byte')
    st('header-too-deep.safetensors', b'{"__metadata__":' + b'[' * 100 + b']' * 100 + b'}', sub='nested deeper')
    # names
    st('dup-name.safetensors', b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
       b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b'\0' * 8, sub='duplicate')
    st('empty-name.safetensors', {'': f32('', 0)}, b'\0' * 8, sub='empty name')
    # entries
    st('entry-not-object.safetensors', {'a': 5}, sub="tensor 'a': entry is an integer")
    st('entry-unknown-key.safetensors', {'a': dict(f32('a', 0), foo=1)}, b'\0' * 8, sub="unknown key 'foo'")
    st('missing-dtype.safetensors', {'a': {'shape': [2], 'data_offsets': [0, 8]}}, b'\0' * 8, sub="tensor 'a': missing dtype")
    st('missing-shape.safetensors', {'a': {'dtype': 'F32', 'data_offsets': [0, 8]}}, b'\0' * 8, sub="tensor 'a': missing shape")
    st('missing-offsets.safetensors', {'a': {'dtype': 'F32', 'shape': [2]}}, b'\0' * 8, sub="tensor 'a': missing data_offsets")
    # dtype
    st('unknown-dtype.safetensors', {'a': {'dtype': 'Q4', 'shape': [2], 'data_offsets': [0, 8]}}, b'\0' * 8, sub="unknown dtype 'Q4'")
    st('lowercase-dtype.safetensors', {'a': {'dtype': 'f32', 'shape': [2], 'data_offsets': [0, 8]}}, b'\0' * 8, sub="unknown dtype 'f32'")
    st('dtype-not-string.safetensors', {'a': {'dtype': 4, 'shape': [2], 'data_offsets': [0, 8]}}, b'\0' * 8, sub='dtype is an integer')
    # shape
    st('negative-dim.safetensors', {'a': {'dtype': 'F32', 'shape': [-1, 2], 'data_offsets': [0, 8]}}, b'\0' * 8, sub='dimension 0 is negative')
    st('real-dim.safetensors', {'a': {'dtype': 'F32', 'shape': [2.0], 'data_offsets': [0, 8]}}, b'\0' * 8, sub='dimension 0 is a real number')
    st('string-dim.safetensors', {'a': {'dtype': 'F32', 'shape': ['2'], 'data_offsets': [0, 8]}}, b'\0' * 8, sub='dimension 0 is a string')
    st('shape-not-list.safetensors', {'a': {'dtype': 'F32', 'shape': 2, 'data_offsets': [0, 8]}}, b'\0' * 8, sub='shape is an integer')
    st('too-many-dims.safetensors', {'a': {'dtype': 'F32', 'shape': [1] * 9, 'data_offsets': [0, 4]}}, b'\0' * 4, sub='9 dimensions')
    st('shape-overflow.safetensors', {'a': {'dtype': 'U8', 'shape': [1 << 32, 1 << 32, 2], 'data_offsets': [0, 8]}}, b'\0' * 8, sub='more elements than fit')
    st('bytes-overflow.safetensors', {'a': {'dtype': 'F64', 'shape': [1 << 62], 'data_offsets': [0, 8]}}, b'\0' * 8, sub='more bytes than fit')
    st('dim-past-int64.safetensors', b'{"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,1]}}', b'\0', sub='invalid JSON')
    st('shape-size-mismatch.safetensors', {'a': {'dtype': 'F32', 'shape': [2, 2], 'data_offsets': [0, 12]}}, b'\0' * 12, sub='is 16 bytes but data_offsets [0, 12] span 12 bytes')
    # offsets
    st('begin-after-end.safetensors', {'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': [8, 4]}}, b'\0' * 8, sub='end before they begin')
    st('offsets-real.safetensors', {'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': [0.0, 4.0]}}, b'\0' * 4, sub='data_offsets must be two non-negative integers')
    st('offsets-string.safetensors', {'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': ['0', '4']}}, b'\0' * 4, sub='data_offsets must be two non-negative integers')
    st('offsets-negative.safetensors', {'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': [-4, 0]}}, b'\0' * 4, sub='data_offsets must be two non-negative integers')
    st('offsets-three.safetensors', {'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': [0, 4, 8]}}, b'\0' * 4, sub='list of two integers')
    st('offsets-not-list.safetensors', {'a': {'dtype': 'F32', 'shape': [1], 'data_offsets': 4}}, b'\0' * 4, sub='list of two integers')
    st('hole.safetensors', {'a': f32('a', 0), 'b': f32('b', 12)}, b'\0' * 20, sub="tensor 'b': hole of 4 bytes")
    st('overlap.safetensors', {'a': f32('a', 0), 'b': f32('b', 4)}, b'\0' * 12, sub="overlap tensor 'a'")
    st('overlap-same.safetensors', {'a': f32('a', 0), 'b': f32('b', 0)}, b'\0' * 8, sub='overlap')
    st('not-from-zero.safetensors', {'a': f32('a', 4)}, b'\0' * 12, sub='does not start at offset 0')
    st('trailing-bytes.safetensors', {'a': f32('a', 0)}, b'\0' * 11, sub='3 trailing bytes')
    st('data-short.safetensors', {'a': f32('a', 0), 'b': f32('b', 8)}, b'\0' * 13, code='ETRUNC', sub="tensor 'b': data_offsets [8, 16] run past the end")
    st('offsets-huge.safetensors', {'a': {'dtype': 'U8', 'shape': [8], 'data_offsets': [(1 << 63) - 9, (1 << 63) - 1]}}, b'\0' * 8, sub='does not start at offset 0')
    # metadata
    st('meta-nonstring.safetensors', {'__metadata__': {'format': 'pt', 'n': 1}, 'a': f32('a', 0)}, b'\0' * 8, sub="__metadata__ key 'n' is an integer")
    st('meta-nested.safetensors', {'__metadata__': {'x': {'y': 'z'}}}, sub="__metadata__ key 'x' is an object")
    st('meta-not-object.safetensors', {'__metadata__': 'pt'}, sub='__metadata__ is a string')

    # model directories
    model_dir('dir-bad-single', {'model.safetensors': st_bytes({'a': f32('a', 0), 'b': f32('b', 12)}, b'\0' * 20)},
              'EDATA', 'hole of 4 bytes')
    model_dir('idx-missing-shard', {
        'model.safetensors.index.json': index({'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}),
        'model-00001-of-00002.safetensors': shard(['a'])}, 'EDATA', "shard 'model-00002-of-00002.safetensors' named by the weight_map does not exist")
    model_dir('idx-tensor-not-in-shard', {
        'model.safetensors.index.json': index({'a': 'model-00001-of-00001.safetensors', 'b': 'model-00001-of-00001.safetensors'}),
        'model-00001-of-00001.safetensors': shard(['a'])}, 'EDATA', "tensor 'b' is listed in shard 'model-00001-of-00001.safetensors', but")
    model_dir('idx-unlisted-tensor', {
        'model.safetensors.index.json': index({'a': 'model-00001-of-00001.safetensors'}),
        'model-00001-of-00001.safetensors': shard(['a', 'c'])}, 'EDATA', "tensor 'c' is not listed in the weight_map")
    model_dir('idx-dup-across-shards', {
        'model.safetensors.index.json': index({'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}),
        'model-00001-of-00002.safetensors': shard(['a']),
        'model-00002-of-00002.safetensors': shard(['a', 'b'])}, 'EDATA', "the weight_map places it in 'model-00001-of-00002.safetensors'")
    model_dir('idx-dotdot', {
        'model.safetensors.index.json': index({'a': '../model-00001-of-00001.safetensors'}),
        'model-00001-of-00001.safetensors': shard(['a'])}, 'EDATA', "no '/' or '..'")
    model_dir('idx-slash', {
        'model.safetensors.index.json': index({'a': '/etc/passwd'})}, 'EDATA', "no '/' or '..'")
    model_dir('idx-empty-shard-name', {
        'model.safetensors.index.json': index({'a': ''})}, 'EDATA', "no '/' or '..'")
    model_dir('idx-shard-not-string', {
        'model.safetensors.index.json': index({'a': 1})}, 'EDATA', "weight_map entry 'a' is an integer")
    model_dir('idx-no-weight-map', {
        'model.safetensors.index.json': '{"metadata": {}}\n'}, 'EDATA', 'missing "weight_map"')
    model_dir('idx-weight-map-list', {
        'model.safetensors.index.json': '{"weight_map": ["a"]}\n'}, 'EDATA', '"weight_map" is a list')
    model_dir('idx-weight-map-empty', {
        'model.safetensors.index.json': '{"weight_map": {}}\n'}, 'EDATA', '"weight_map" is empty')
    model_dir('idx-not-object', {
        'model.safetensors.index.json': '["weight_map"]\n'}, 'EDATA', 'not a JSON object')
    model_dir('idx-invalid-json', {
        'model.safetensors.index.json': '{"weight_map": {"a": "x.safetensors",}}\n'}, 'EDATA', 'invalid JSON')
    model_dir('idx-dup-key', {
        'model.safetensors.index.json': '{"weight_map": {"a": "s.safetensors", "a": "s.safetensors"}}\n',
        's.safetensors': shard(['a'])}, 'EDATA', 'duplicate')
    model_dir('idx-bad-shard', {
        'model.safetensors.index.json': index({'a': 'model-00001-of-00001.safetensors'}),
        'model-00001-of-00001.safetensors': st_bytes({'a': f32('a', 0)}, b'\0' * 9)}, 'EDATA', '1 trailing bytes')
    model_dir('idx-truncated-shard', {
        'model.safetensors.index.json': index({'a': 'model-00001-of-00001.safetensors'}),
        'model-00001-of-00001.safetensors': st_bytes({'a': f32('a', 0)}, b'\0' * 7)}, 'ETRUNC', 'run past the end')

    with open(os.path.join(HERE, 'MANIFEST'), 'w') as f:
        f.write('# Written by gen.py: name<TAB>code<TAB>substring of the message. Do not edit; rerun gen.py.\n')
        for name, code, sub in cases:
            f.write('%s\t%s\t%s\n' % (name, code, sub))


if __name__ == '__main__':
    main()
