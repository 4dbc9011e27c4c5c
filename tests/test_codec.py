"""Tensor codec: bit-exact roundtrips for every dtype, the blob format, corruption, threads.

Tensors are compared on their bytes (``torch.equal`` on uint8 views) so NaN payloads, -0.0 and
subnormals count, and so that dtypes without comparison kernels (uint3, bits16, float8_e8m0fnu)
are compared too.
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logstore import codec
from logstore.codec import TensorHeader, checksum, decode_tensor, encode_tensor, read_header, verify_blob
from logstore.errors import CodecError, ConfigError, CorruptRecordError
from logstore.keys import Channel, RecordKey

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

ALL_DTYPES = sorted(codec._DTYPE_TO_CODE, key=str)
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
FORCED = ["raw", "zstd", "planes"]
KEY = RecordKey(Channel.activation(2), 17, 3, 1)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical tensor's bytes in C order, whatever its dtype, strides or conj bit."""
    t = t.detach().resolve_conj().resolve_neg()
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if carrier is not None:
        t = t.view(carrier)
    flat = t.contiguous().reshape(-1)
    return flat.as_strided((flat.numel(),), (1,)).view(torch.uint8)


def from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` and ``shape`` whose bytes are ``data``."""
    u8 = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return u8.reshape(*shape, dtype.itemsize).view(dtype).squeeze(-1).reshape(shape)


def assert_same(decoded: torch.Tensor, original: torch.Tensor) -> None:
    assert decoded.dtype == original.dtype
    assert tuple(decoded.shape) == tuple(original.shape)
    assert decoded.is_contiguous() and decoded.device.type == "cpu"
    assert torch.equal(as_bytes(decoded), as_bytes(original))


def realistic(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)


# -- the dtype table ---------------------------------------------------------------------------


def test_table_covers_every_required_dtype() -> None:
    required = [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    for name in required:
        dt = getattr(torch, name, None)
        if dt is not None:
            assert dt in codec._DTYPE_TO_CODE, name
    codes = list(codec._DTYPE_TO_CODE.values())
    assert len(codes) == len(set(codes)) and all(0 < c < 256 for c in codes)


def test_dtype_codes_are_pinned() -> None:
    # the wire format: these numbers must never change
    for name, code in [
        ("bool", 1),
        ("int64", 9),
        ("float16", 16),
        ("bfloat16", 17),
        ("float32", 18),
        ("float64", 19),
        ("complex64", 25),
        ("float8_e4m3fn", 32),
        ("float8_e5m2", 33),
    ]:
        assert codec._DTYPE_TO_CODE[getattr(torch, name)] == code


# -- property roundtrips -----------------------------------------------------------------------

SPECIALS = [
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    1.0,
    -2.5,
    1e-40,
    -1e-45,
    5e-324,
    1e-8,
    6e-8,
    3.4e38,
    -65504.0,
    1e300,
]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Any dtype, 0-d to 4-d, empty dims, random bits or special floats, contiguous or a view."""
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    view = draw(st.sampled_from(["none", "transpose", "step", "expand", "offset", "conj", "grad"]))
    base_shape = shape
    if view == "step" and shape:
        base_shape = (2 * shape[0], *shape[1:])
    if view == "expand" and shape:
        base_shape = (1, *shape[1:])
    if view == "transpose" and len(shape) >= 2:
        base_shape = (shape[-1], *shape[1:-1], shape[0])
    n = math.prod(base_shape) + (1 if view == "offset" else 0)
    if dtype in FLOATS and draw(st.booleans()):
        vals = draw(st.lists(st.sampled_from(SPECIALS), min_size=n, max_size=n))
        flat = torch.tensor(vals, dtype=torch.float64).to(dtype)
        data = as_bytes(flat).numpy().tobytes()
    else:
        data = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if view == "offset":
        t = from_bytes(data, dtype, (n,))[1:].reshape(base_shape)
    else:
        t = from_bytes(data, dtype, base_shape)
    if view == "step" and shape:
        t = t[::2]
    elif view == "expand" and shape:
        t = t.expand(shape)
    elif view == "transpose" and len(shape) >= 2:
        t = t.transpose(0, -1)
    elif view == "conj" and dtype.is_complex and dtype != torch.complex32:
        t = t.conj()
    elif view == "grad" and dtype in FLOATS:
        t = t.clone().requires_grad_(True)
    assert tuple(t.shape) == shape
    return t


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors(), codec_name=st.sampled_from(["auto", *FORCED]), level=st.sampled_from([1, 3, -5]))
def test_roundtrip_any_tensor(t: torch.Tensor, codec_name: str, level: int) -> None:
    blob = encode_tensor(t, codec=codec_name, level=level)
    assert isinstance(blob, bytes)
    out = decode_tensor(blob)
    assert_same(out, t)
    h = read_header(blob)
    assert h.dtype == t.dtype and h.shape == tuple(t.shape)
    assert h.raw_len == t.numel() * t.element_size()
    assert h.header_len + h.stored_len == len(blob)
    assert h.checksum == checksum(as_bytes(t).numpy())
    if codec_name != "auto":
        assert h.codec == codec_name
    assert verify_blob(memoryview(blob)) == h


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS + [torch.complex64, torch.complex128]),
    n=st.integers(0, 3000),
    scale=st.sampled_from([1e-30, 1e-6, 0.02, 1.0, 1e4]),
    codec_name=st.sampled_from(["auto", "planes"]),
)
def test_roundtrip_realistic_floats(dtype: torch.dtype, n: int, scale: float, codec_name: str) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    t = torch.complex(x, x.flip(0)).to(dtype) if dtype.is_complex else x.to(dtype)
    assert_same(decode_tensor(encode_tensor(t, codec=codec_name)), t)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("codec_name", FORCED)
def test_special_float_bit_patterns(dtype: torch.dtype, codec_name: str) -> None:
    bits = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32, torch.float64: 64}[dtype]
    it = {16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
    exp_mask = {
        torch.bfloat16: 0x7F80,
        torch.float16: 0x7C00,
        torch.float32: 0x7F800000,
        torch.float64: 0x7FF0000000000000,
    }[dtype]
    sign = 1 << (bits - 1)
    patterns = [
        exp_mask | 1,  # signalling NaN, payload 1
        exp_mask | (exp_mask >> 1 & ~exp_mask) | 0x15,  # quiet NaN with a payload
        sign | exp_mask | 3,  # negative NaN
        exp_mask,
        sign | exp_mask,  # +-inf
        0,
        sign,  # +-0.0
        1,
        sign | 1,
        (exp_mask >> 1) & ~exp_mask & (exp_mask - 1),  # subnormals
    ]
    ints = [p - (1 << bits) if p >= sign else p for p in patterns] * 50
    t = torch.tensor(ints, dtype=it).view(dtype)
    out = decode_tensor(encode_tensor(t, codec=codec_name))
    assert torch.equal(out.view(it), t.view(it))


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d.itemsize > 1 or d == torch.bool])
def test_every_dtype_every_codec_large(dtype: torch.dtype) -> None:
    # crosses chunk, piece and hash-chunk boundaries; non-floats use structured data so the
    # compressed paths are taken
    n = 600_001
    if dtype in FLOATS or dtype.is_complex:
        x = torch.randn(n * (2 if dtype.is_complex else 1), dtype=torch.float64)
        t = x.view(torch.complex128).to(dtype) if dtype.is_complex else x.to(dtype)
    else:
        ramp = (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8).repeat_interleave(dtype.itemsize)
        t = from_bytes(ramp.numpy().tobytes(), dtype, (n,))
    for name in ["auto", *FORCED]:
        assert_same(decode_tensor(encode_tensor(t, codec=name)), t)


def test_big_float_tensor_crosses_every_boundary() -> None:
    t = realistic(torch.bfloat16, 5_000_003).reshape(-1)  # 10 MB: > piece, hash chunk and L2 chunk
    blob = encode_tensor(t)
    assert read_header(blob).codec == "planes"
    assert_same(decode_tensor(blob), t)
    t2 = realistic(torch.float32, 3 * 1024 * 1024 + 7)[1:].reshape(-1, 3)[:, 1]  # strided view
    assert_same(decode_tensor(encode_tensor(t2)), t2)


def test_segments_decide_raw_or_compressed_independently() -> None:
    seg = codec._SEGMENT_BYTES // 2  # bf16 words per segment
    noise = torch.randint(-(2**15), 2**15 - 1, (seg,), dtype=torch.int16).view(torch.bfloat16)
    t = torch.cat([realistic(torch.bfloat16, seg), noise, realistic(torch.bfloat16, seg // 3, seed=1)])
    blob = encode_tensor(t, codec="planes")
    layout = codec._parse(memoryview(blob), None)[1]
    assert layout is not None and len(layout.segments) == 3
    assert [seg_planes[0][0] for seg_planes in layout.segments] == [1, 0, 1]  # exponent: zstd, raw, zstd
    assert_same(decode_tensor(blob), t)


def test_zero_d_and_empty() -> None:
    for t in [
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.tensor(True),
        torch.empty(0, 7),
        torch.empty(3, 0, 2, dtype=torch.int64),
        torch.empty((), dtype=torch.float8_e5m2),
    ]:
        for name in ["auto", *FORCED]:
            blob = encode_tensor(t, codec=name)
            assert_same(decode_tensor(blob), t)


def test_requires_grad_and_non_contiguous_inputs() -> None:
    w = torch.randn(64, 48, requires_grad=True)
    y = (w * 2).t()  # non-leaf, transposed, requires grad
    assert_same(decode_tensor(encode_tensor(y)), y.detach())
    c = torch.randn(16, 16, dtype=torch.complex64).conj()  # lazy conj bit
    assert c.is_conj()
    assert_same(decode_tensor(encode_tensor(c)), c.resolve_conj())
    cl = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    assert_same(decode_tensor(encode_tensor(cl)), cl.contiguous())


def test_encode_does_not_touch_input() -> None:
    t = realistic(torch.bfloat16, 10_000).reshape(100, 100).t()
    before = as_bytes(t).clone()
    encode_tensor(t)
    assert torch.equal(as_bytes(t), before)


def test_decoded_tensor_owns_its_memory() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    buf = bytearray(encode_tensor(t, codec="raw"))
    out = decode_tensor(memoryview(buf))
    buf[:] = bytes(len(buf))
    assert torch.equal(out, torch.arange(1000, dtype=torch.int32))
    out += 1  # writable
    assert out.untyped_storage().nbytes() == 4000


# -- auto choices and ratios -------------------------------------------------------------------


def test_auto_picks_planes_for_floats_zstd_for_ints_raw_when_useless() -> None:
    assert read_header(encode_tensor(realistic(torch.bfloat16, 50_000))).codec == "planes"
    assert read_header(encode_tensor(realistic(torch.float32, 50_000))).codec == "planes"
    assert read_header(encode_tensor(torch.arange(50_000) % 7)).codec == "zstd"
    noise = torch.randint(-(2**31), 2**31 - 1, (50_000,), dtype=torch.int32)
    assert read_header(encode_tensor(noise)).codec == "raw"
    noise_f = torch.randint(-(2**15), 2**15 - 1, (50_000,), dtype=torch.int16).view(torch.bfloat16)
    blob = encode_tensor(noise_f)
    assert read_header(blob).codec == "raw"
    assert len(blob) - read_header(blob).header_len == noise_f.numel() * 2
    assert read_header(encode_tensor(torch.zeros(3))).codec == "raw"  # tiny


def test_planes_beat_zstd_on_gaussian_floats() -> None:
    for dtype, target in [(torch.bfloat16, 1.4), (torch.float32, 1.15)]:
        t = realistic(dtype, 500_000)
        raw = t.numel() * t.element_size()
        planes = raw / len(encode_tensor(t))
        z1 = raw / len(encode_tensor(t, codec="zstd", level=1))
        assert planes > target and planes > z1 * 1.05, (dtype, planes, z1)


def test_bf16_exponent_plane_holds_exactly_the_exponent_bits() -> None:
    t = realistic(torch.bfloat16, 100_000)
    blob = encode_tensor(t, codec="planes")
    # parse the documented layout by hand: this pins the wire format
    magic, version, dcode, cid, ndim, raw_len, payload_len, digest = struct.unpack_from("<4sBBBBQQQ", blob)
    assert (magic, version, dcode, cid, ndim, raw_len) == (b"SLTN", 1, 17, 2, 1, 200_000)
    pos = 32 + 8 * ndim
    rotate, word, nplanes, seg_words = struct.unpack_from("<BBBI", blob, pos)
    assert (rotate, word, nplanes) == (1, 2, 2) and seg_words >= 100_000  # one segment
    fields = [struct.unpack_from("<BB", blob, pos + 7 + 2 * i) for i in range(nplanes)]
    assert fields == [(1, 1), (0, 1)]  # exponent first
    planes = [struct.unpack_from("<BI", blob, pos + 7 + 2 * nplanes + 5 * i) for i in range(nplanes)]
    hlen = pos + 7 + 2 * nplanes + 5 * nplanes + 8
    assert struct.unpack_from("<Q", blob, hlen - 8)[0] == xxhash.xxh3_64_intdigest(blob[: hlen - 8])
    assert digest == xxhash.xxh3_64_intdigest(as_bytes(t).numpy())
    (m0, len0), (m1, len1) = planes
    assert m0 == 1  # the exponent plane is compressed
    assert hlen + len0 + len1 == len(blob) and len0 + len1 == payload_len
    exp_plane = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob[hlen : hlen + len0]), np.uint8)
    u = t.view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(exp_plane, ((u >> 7) & 0xFF).astype(np.uint8))
    other = blob[hlen + len0 :]
    other = zstandard.ZstdDecompressor().decompress(other) if m1 else other
    assert np.array_equal(np.frombuffer(other, np.uint8), (((u & 0x7F) << 1) | (u >> 15)).astype(np.uint8))


def test_raw_blob_layout_is_pinned() -> None:
    t = torch.tensor([[1, 2, 3]], dtype=torch.int16)
    raw = t.numpy().tobytes()
    body = struct.pack("<4sBBBBQQQ", b"SLTN", 1, 5, 0, 2, 6, 6, xxhash.xxh3_64_intdigest(raw))
    body += struct.pack("<2Q", 1, 3)
    expected = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + raw
    assert encode_tensor(t, codec="raw") == expected
    h = read_header(expected)
    assert h == TensorHeader(torch.int16, (1, 3), "raw", 6, 6, xxhash.xxh3_64_intdigest(raw), len(body) + 8)


def test_fallback_coder_roundtrips_and_compresses(monkeypatch: pytest.MonkeyPatch) -> None:
    t = realistic(torch.bfloat16, 300_000)
    fast = encode_tensor(t)
    monkeypatch.setattr(codec, "_use_huf", False)
    slow = encode_tensor(t)
    assert_same(decode_tensor(slow), t)
    assert_same(decode_tensor(fast), t)
    assert len(slow) < 1.02 * len(fast)
    assert_same(decode_tensor(encode_tensor(t, level=5)), t)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="lz4"):
        encode_tensor(torch.zeros(3), codec="lz4")
    with pytest.raises(ConfigError, match="99"):
        encode_tensor(torch.zeros(3), level=99)
    with pytest.raises(TypeError):
        encode_tensor(np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="meta"):
        encode_tensor(torch.empty(3, device="meta"))
    with pytest.raises(CodecError, match="dense"):
        encode_tensor(torch.eye(3).to_sparse())
    with pytest.raises(CodecError, match="quantized"):
        encode_tensor(torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8))
    with pytest.raises(TypeError):
        decode_tensor("not bytes")  # type: ignore[arg-type]


def _small_blobs() -> dict[str, bytes]:
    return {
        "raw": encode_tensor(realistic(torch.float32, 40).reshape(5, 8), codec="raw"),
        "zstd": encode_tensor(torch.arange(300, dtype=torch.int64) % 9, codec="zstd"),
        "planes": encode_tensor(realistic(torch.bfloat16, 400).reshape(20, 20), codec="planes"),
        "planes_fp32": encode_tensor(realistic(torch.float32, 150), codec="planes"),
        "empty": encode_tensor(torch.empty(0, 3), codec="planes"),
    }


@pytest.mark.parametrize("name", list(_small_blobs()))
def test_every_single_bit_flip_is_detected(name: str) -> None:
    blob = _small_blobs()[name]
    original = decode_tensor(blob)
    assert read_header(blob).codec == ("planes" if name == "empty" else name.split("_")[0])
    for bit in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            out = decode_tensor(bytes(bad), key=KEY)
        except (CorruptRecordError, CodecError) as e:
            assert str(KEY) in str(e), (bit, str(e))
            continue
        # a flip zstd ignores is harmless; anything decoded must be the original exactly
        assert_same(out, original)


@pytest.mark.parametrize("name", list(_small_blobs()))
def test_truncated_or_extended_blob_is_codec_error(name: str) -> None:
    blob = _small_blobs()[name]
    for cut in range(len(blob)):
        with pytest.raises(CodecError):
            decode_tensor(blob[:cut], key=KEY)
    with pytest.raises(CodecError, match="trailing"):
        decode_tensor(blob + b"\0", key=KEY)
    with pytest.raises(CodecError):
        read_header(blob[: len(blob) // 3])


def test_payload_corruption_is_corrupt_record_error_with_key() -> None:
    t = realistic(torch.bfloat16, 20_000)
    for name in FORCED:
        blob = bytearray(encode_tensor(t, codec=name))
        h = read_header(blob)
        blob[h.header_len + h.stored_len // 2] ^= 0x10
        with pytest.raises(CorruptRecordError) as ei:
            decode_tensor(blob, key=KEY)
        assert ei.value.key == KEY and str(KEY) in str(ei.value)
        with pytest.raises(CorruptRecordError):
            verify_blob(blob, key=KEY)
        assert read_header(blob) == h  # header alone is still fine: no payload check there


def test_header_corruption_and_bad_magic() -> None:
    blob = bytearray(encode_tensor(torch.arange(100)))
    bad = bytearray(blob)
    bad[9] ^= 1  # raw length
    with pytest.raises(CorruptRecordError, match="header checksum"):
        read_header(bad, key=KEY)
    with pytest.raises(CodecError, match="magic"):
        decode_tensor(b"XXXX" + blob[4:], key=KEY)
    with pytest.raises(CodecError, match="version"):
        decode_tensor(blob[:4] + b"\x09" + blob[5:])
    with pytest.raises(CodecError):
        decode_tensor(b"")


def _reseal(body: bytes, payload: bytes) -> bytes:
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + payload


def test_well_sealed_but_inconsistent_headers_are_codec_errors() -> None:
    raw = bytes(8)
    d = xxhash.xxh3_64_intdigest(raw)

    def head(dtype: int = 9, cid: int = 0, raw_len: int = 8, pay: int = 8, shape: tuple[int, ...] = (1,)) -> bytes:
        return struct.pack("<4sBBBBQQQ", b"SLTN", 1, dtype, cid, len(shape), raw_len, pay, d) + struct.pack(
            f"<{len(shape)}Q", *shape
        )

    def planes_head(
        rot: int = 0, word: int = 8, seg: int = 1, fields: tuple = ((0, 8),), segs: tuple = ((0, 8),)
    ) -> bytes:
        out = struct.pack("<BBBI", rot, word, len(fields), seg)
        out += b"".join(struct.pack("<BB", *f) for f in fields)
        return out + b"".join(struct.pack("<BI", *sp) for sp in segs)

    assert_same(decode_tensor(_reseal(head(), raw)), torch.zeros(1, dtype=torch.int64))
    cases = {
        "unknown dtype": _reseal(head(dtype=250), raw),
        "unknown codec": _reseal(head(cid=7), raw),
        "shape": _reseal(head(shape=(2,)), raw),
        "raw length": _reseal(head(raw_len=8, pay=4, shape=(1,)), raw[:4]),
        "tile": _reseal(head(cid=2) + planes_head(fields=((0, 4),), segs=((0, 8),)), raw),
        "overlap": _reseal(head(cid=2) + planes_head(fields=((0, 4), (2, 4)), segs=((0, 4), (0, 4))), raw),
        "word": _reseal(head(cid=2) + planes_head(word=3, fields=((0, 1),)), raw),
        "segment": _reseal(head(cid=2) + planes_head(seg=0), raw),
        "method": _reseal(head(cid=2) + planes_head(segs=((9, 8),)), raw),
        "transform": _reseal(head(cid=2) + planes_head(rot=7), raw),
        "raw plane": _reseal(head(cid=2, pay=7) + planes_head(segs=((0, 7),)), raw[:7]),
        "sum": _reseal(head(cid=2) + planes_head(segs=((1, 7),)), raw),
    }
    assert_same(decode_tensor(_reseal(head(cid=2) + planes_head(), raw)), torch.zeros(1, dtype=torch.int64))
    for what, blob in cases.items():
        with pytest.raises(CodecError) as ei:
            decode_tensor(blob, key=KEY)
        assert str(KEY) in str(ei.value), what


def test_zstd_frame_lying_about_its_size_is_corrupt() -> None:
    raw = bytes(1000)
    frame = zstandard.ZstdCompressor().compress(bytes(999))
    body = struct.pack("<4sBBBBQQQ", b"SLTN", 1, 2, 1, 1, 1000, len(frame), xxhash.xxh3_64_intdigest(raw))
    body += struct.pack("<Q", 1000)
    with pytest.raises(CorruptRecordError, match="999"):
        decode_tensor(_reseal(body, frame), key=KEY)


def test_checksum_function() -> None:
    data = bytes(range(256)) * 40000  # > one hash chunk
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    assert checksum(memoryview(data)[5:]) == xxhash.xxh3_64_intdigest(data[5:])
    assert checksum(b"") == xxhash.xxh3_64_intdigest(b"")


# -- threads -----------------------------------------------------------------------------------


def test_concurrent_encode_decode() -> None:
    inputs = [
        realistic(torch.bfloat16, 200_000, seed=1),
        realistic(torch.float32, 100_000, seed=2),
        torch.arange(100_000, dtype=torch.int64) % 1000,
        realistic(torch.float16, 150_000, seed=3).reshape(300, 500).t(),
    ]
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for r in range(8):
                t = inputs[(i + r) % len(inputs)]
                name = ["auto", *FORCED][(i * 3 + r) % 4]
                assert_same(decode_tensor(encode_tensor(t, codec=name)), t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
