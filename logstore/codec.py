"""Tensor codec: one CPU tensor <-> one self-describing, checksummed blob.

What it promises:

- Lossless for every dtype in the table below, any shape (0-d, empty, huge), any strides: the
  blob holds the logical tensor in C order, and :func:`decode_tensor` gives back a fresh,
  contiguous CPU tensor whose bytes equal the original's (NaN payloads, -0.0 and subnormals
  included).
- Never returns wrong bytes: the raw bytes carry an xxh3_64 checksum and the header carries its
  own, so a flipped bit anywhere raises :class:`~logstore.errors.CorruptRecordError` (checksum
  mismatch, undecodable compressed data) or :class:`~logstore.errors.CodecError` (not a
  well-formed record: bad magic/version, truncated, unknown dtype/codec, inconsistent lengths).
- Safe to call from several threads at once; zstd contexts and scratch buffers are per thread.
  The heavy work (numpy integer ops, zstd, xxh3, the final join) releases the GIL; what holds it
  is bounded by small chunks (copies of at most 1 MB), so other Python threads keep running.

What it never does: touch a GPU (non-CPU tensors are refused; the caller copies to host first),
change torch's thread settings, or keep a reference to the caller's tensor or blob.

Codecs
------
``raw``     the raw bytes.
``zstd``    one zstd frame of the raw bytes at ``level``.
``planes``  float-aware byte planes. Each element is read as an unsigned word (the component
            word for complex dtypes), rotated left by one bit for floats so that the sign moves to
            the lowest bit and the exponent starts at the top, then cut into fields ("planes")
            that are stored one after another. For bf16 the top plane is exactly the 8 exponent
            bits and the other plane is mantissa+sign; for fp16 the top plane is the 5 exponent
            bits plus the top 3 mantissa bits; for fp32 the planes are exponent, top mantissa
            byte and the low 16 bits; for fp64 exponent-high byte, exponent-low+mantissa byte,
            then 16 and 32 low bits. The exponent plane is always entropy-coded; every other
            plane is tried on a small sample first and only compressed when that pays, since
            mantissa bits are close to random. Non-float dtypes are split into plain byte planes
            (byte shuffle). With ``level <= 1`` planes use a Huffman-only zstd mode (the exponent
            plane has ~2.6 bits of entropy and no long matches, so LZ matching only costs time);
            with ``level >= 2`` they use regular zstd at that level.
``auto``    ``planes`` for float16/bfloat16/float32/float64 and their complex forms, ``zstd`` for
            everything else; raw whenever compression does not make the blob smaller.

Blob layout (version 1, all integers little-endian)
---------------------------------------------------
::

    offset  size      field
    0       4         magic b"SLTN"
    4       1         version (1)
    5       1         dtype code (stable table below, not torch's enum values)
    6       1         codec id: 0 raw, 1 zstd, 2 planes
    7       1         ndim
    8       8         raw length in bytes (= prod(shape) * itemsize)
    16      8         payload length in bytes
    24      8         xxh3_64 of the raw bytes (logical tensor, C order)
    32      8*ndim    shape, one u64 per dimension
    -- only for codec planes --
    +0      1         transform: 0 none, 1 rotate each word left by one bit
    +1      1         word size W in bytes (divides the itemsize); N = raw length / W words
    +2      1         number of planes P
    +3      4         segment length L in words (u32); S = ceil(N / L) segments
    +7      2*P       per plane: field offset in the word (bytes, u8), field width (1, 2, 4, 8)
    +7+2P   5*P*S     per segment, per plane: method (0 raw, 1 zstd frame, u8), stored length (u32)
    -- always --
    end-8   8         xxh3_64 of every header byte before it
    header_len ...    payload (payload length bytes; the blob ends exactly there)

Planes payload: for each segment (words [s*L, min((s+1)*L, N))), each plane in field order, the
stored bytes of that plane: the field values as little-endian integers of the field width, raw or
as one zstd frame (with its content size). A field at offset ``o`` of width ``w`` holds
``(t(word) >> 8*o) mod 2**(8*w)`` where ``t`` is the transform; the fields tile the word exactly.
Segments (2 MB of raw tensor) keep per-thread scratch bounded and the planes in cache.

Dtype codes: bool 1; uint8 2, int8 3, uint16 4, int16 5, uint32 6, int32 7, uint64 8, int64 9;
float16 16, bfloat16 17, float32 18, float64 19; complex32 24, complex64 25, complex128 26;
float8_e4m3fn 32, float8_e5m2 33, float8_e4m3fnuz 34, float8_e5m2fnuz 35, float8_e8m0fnu 36;
float4_e2m1fn_x2 40; uint1..uint7 48..54; int1..int7 56..62; bits8 64, bits16 65, bits1x8 66,
bits2x4 67, bits4x2 68. Codes of dtypes this torch build lacks are kept reserved.

One module, over 600 lines, because it is one format: its encoder and decoder share the layout
structs, the dtype table and the plane plan, and each change of the format touches both.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
import xxhash
import zstandard

from logstore.errors import CodecError, ConfigError, CorruptRecordError

__all__ = [
    "TensorHeader",
    "encode_tensor",
    "decode_tensor",
    "read_header",
    "verify_blob",
    "checksum",
]

logger = logging.getLogger(__name__)

Blob = bytes | bytearray | memoryview

MAGIC: Final = b"SLTN"
VERSION: Final = 1
_FIXED = struct.Struct("<4sBBBBQQQ")  # magic, version, dtype, codec, ndim, raw_len, payload_len, checksum
_PLANES_HEAD = struct.Struct("<BBBI")  # transform, word size, plane count, segment length in words
_FIELD = struct.Struct("<BB")  # plane field: offset, width
_SEG_PLANE = struct.Struct("<BI")  # per segment and plane: method, stored length
_HCHECK = struct.Struct("<Q")

CODECS: Final = ("auto", "raw", "zstd", "planes")
_CODEC_IDS: Final = {"raw": 0, "zstd": 1, "planes": 2}
_CODEC_NAMES: Final = {v: k for k, v in _CODEC_IDS.items()}
_RAW, _ZSTD = 0, 1  # plane methods
_ROT_NONE, _ROT_LEFT1 = 0, 1

# Work unit for the numpy passes: small enough to stay in L2, large enough that per-call
# overhead is noise. Each ufunc call on it releases the GIL.
_CHUNK_BYTES: Final = 256 * 1024
# Hash in pieces so xxh3 never holds the GIL for long on a huge tensor.
_HASH_CHUNK: Final = 4 * 1024 * 1024
# Largest copy made while holding the GIL (numpy -> bytes), ~0.1 ms.
_PIECE: Final = 1024 * 1024
# The planes codec works segment by segment: per-thread scratch stays this small whatever the
# tensor size, and each segment's planes are still in cache when they are compressed.
_SEGMENT_BYTES: Final = 2 * 1024 * 1024
# Planes that are not known to compress are tried on this many bytes first (4 spans).
_SAMPLE_BYTES: Final = 32 * 1024
_SAMPLE_MIN_GAIN: Final = 0.02  # compress a tried plane only if its sample shrinks by >= 2 %
_TINY: Final = 128  # auto stores tensors this small raw: a zstd frame cannot pay for itself
_KEEP_SCRATCH: Final = 16 * 1024 * 1024  # per-thread scratch above this is not kept
_MAX_LEVEL: Final = zstandard.MAX_COMPRESSION_LEVEL
_MIN_LEVEL: Final = -(1 << 17)
# Huffman-only mode: a very negative level turns the match finder into a fast skip over the
# input; forcing literal compression back on keeps the Huffman stage (negative levels drop it).
_HUF_LEVEL: Final = -(1 << 17)  # ZSTD_minCLevel()

# -- dtype table -------------------------------------------------------------------------------

_DTYPE_NAMES: Final = (
    (1, "bool"),
    (2, "uint8"),
    (3, "int8"),
    (4, "uint16"),
    (5, "int16"),
    (6, "uint32"),
    (7, "int32"),
    (8, "uint64"),
    (9, "int64"),
    (16, "float16"),
    (17, "bfloat16"),
    (18, "float32"),
    (19, "float64"),
    (24, "complex32"),
    (25, "complex64"),
    (26, "complex128"),
    (32, "float8_e4m3fn"),
    (33, "float8_e5m2"),
    (34, "float8_e4m3fnuz"),
    (35, "float8_e5m2fnuz"),
    (36, "float8_e8m0fnu"),
    (40, "float4_e2m1fn_x2"),
    *((47 + i, f"uint{i}") for i in range(1, 8)),
    *((55 + i, f"int{i}") for i in range(1, 8)),
    (64, "bits8"),
    (65, "bits16"),
    (66, "bits1x8"),
    (67, "bits2x4"),
    (68, "bits4x2"),
)


def _build_dtype_table() -> tuple[dict[int, torch.dtype], dict[torch.dtype, int]]:
    by_code: dict[int, torch.dtype] = {}
    by_dtype: dict[torch.dtype, int] = {}
    for code, name in _DTYPE_NAMES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype) and dt not in by_dtype:
            by_code[code] = dt
            by_dtype[dt] = code
    return by_code, by_dtype


_CODE_TO_DTYPE, _DTYPE_TO_CODE = _build_dtype_table()

# Float layouts for the planes codec: word size -> fields (offset, width, always-compress) of the
# word rotated left by one bit, exponent first.
_FLOAT_WORD: Final = {
    torch.float16: 2,
    torch.bfloat16: 2,
    torch.complex32: 2,
    torch.float32: 4,
    torch.complex64: 4,
    torch.float64: 8,
    torch.complex128: 8,
}
_FLOAT_FIELDS: Final = {
    2: ((1, 1, True), (0, 1, False)),
    4: ((3, 1, True), (2, 1, False), (0, 2, False)),
    8: ((7, 1, True), (6, 1, False), (4, 2, False), (0, 4, False)),
}
_UINT: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CARRIER: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """What a blob says about its tensor, read without decompressing anything.

    ``stored_len`` is the payload size in bytes (blob size = ``header_len + stored_len``);
    ``checksum`` is the xxh3_64 of the raw bytes.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: str
    raw_len: int
    stored_len: int
    checksum: int
    header_len: int


@dataclass(frozen=True, slots=True)
class _Layout:
    """The planes part of a header."""

    rotate: int
    word: int
    seg_words: int
    fields: tuple[tuple[int, int], ...]  # (offset, width) per plane, in payload order
    segments: tuple[tuple[tuple[int, int], ...], ...]  # per segment, per plane: (method, stored length)

    @property
    def stored_len(self) -> int:
        return sum(length for seg in self.segments for _, length in seg)


# -- per-thread state --------------------------------------------------------------------------

_tls = threading.local()


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread uint8 buffer of ``nbytes``; reused across calls to avoid page faults."""
    if nbytes > _KEEP_SCRATCH:
        return np.empty(nbytes, dtype=np.uint8)
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = bufs[name] = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
    return buf[:nbytes]


# The Huffman-only mode needs ZSTD_c_literalCompressionMode, which python-zstandard's C backend
# does not expose; its cffi backend exposes the raw zstd API. Without cffi, fall back to regular
# zstd parameters tuned to find almost no matches (measured ~10 % slower, ratio within 0.1 %).
try:
    from zstandard.backend_cffi import ffi as _ffi  # type: ignore[attr-defined]
    from zstandard.backend_cffi import lib as _zlib

    _HAVE_HUF = bool(hasattr(_zlib, "ZSTD_c_literalCompressionMode") and hasattr(_zlib, "ZSTD_compress2"))
except Exception:  # noqa: BLE001 - any import failure just means the fallback path
    _ffi = _zlib = None
    _HAVE_HUF = False
    logger.debug("zstandard cffi backend unavailable; planes use the regular zstd fallback")

_FALLBACK_PARAMS: Final = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST,
    window_log=20,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
)


class _HufCoder:
    """Huffman-only zstd through the raw API; one per thread, frames readable by any zstd."""

    def __init__(self) -> None:
        cctx = _zlib.ZSTD_createCCtx()
        if cctx == _ffi.NULL:
            raise MemoryError("ZSTD_createCCtx failed")
        self._cctx = _ffi.gc(cctx, _zlib.ZSTD_freeCCtx)
        for param, value in (
            (_zlib.ZSTD_c_compressionLevel, _HUF_LEVEL),
            (_zlib.ZSTD_c_literalCompressionMode, 1),  # ZSTD_ps_enable
            (_zlib.ZSTD_c_contentSizeFlag, 1),
        ):
            rc = _zlib.ZSTD_CCtx_setParameter(self._cctx, param, value)
            if _zlib.ZSTD_isError(rc):
                raise RuntimeError(_ffi.string(_zlib.ZSTD_getErrorName(rc)).decode())

    def compress(self, data: np.ndarray) -> np.ndarray:
        """One zstd frame of ``data``, in per-thread scratch valid until the next call."""
        cap = _zlib.ZSTD_compressBound(data.nbytes)
        dst = _scratch("huf_out", cap)
        rc = _zlib.ZSTD_compress2(self._cctx, _ffi.from_buffer(dst), cap, _ffi.from_buffer(data), data.nbytes)
        if _zlib.ZSTD_isError(rc):
            raise zstandard.ZstdError(_ffi.string(_zlib.ZSTD_getErrorName(rc)).decode())
        return dst[:rc]


_use_huf = _HAVE_HUF  # tests flip this to cover the fallback


_Coder = Callable[[np.ndarray], "bytes | np.ndarray"]


def _plane_coder(level: int) -> _Coder:
    if level >= 2:
        return _zstd_compressor(level).compress
    if _use_huf:
        h = getattr(_tls, "huf", None)
        if h is None:
            h = _tls.huf = _HufCoder()
        return h.compress
    c = getattr(_tls, "huf_fallback", None)
    if c is None:
        c = _tls.huf_fallback = zstandard.ZstdCompressor(compression_params=_FALLBACK_PARAMS)
    return c.compress


# -- helpers -----------------------------------------------------------------------------------


def checksum(data: Blob) -> int:
    """xxh3_64 of ``data`` (any contiguous buffer) as an unsigned int. Never copies ``data``."""
    mv = memoryview(data).cast("B")
    if mv.nbytes <= _HASH_CHUNK:
        return xxhash.xxh3_64_intdigest(mv)
    h = xxhash.xxh3_64()
    for i in range(0, mv.nbytes, _HASH_CHUNK):
        h.update(mv[i : i + _HASH_CHUNK])
    return h.intdigest()


def _where(key: object) -> str:
    return "" if key is None else f" (record {key})"


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of the logical tensor in C order, as a uint8 numpy array (a view when possible)."""
    if t.device.type != "cpu":
        raise CodecError(
            f"cannot encode a tensor on device {t.device}: the codec works on host memory only",
            hint="copy it to the host first, e.g. t.to('cpu', non_blocking=True) into pinned memory",
        )
    if t.layout != torch.strided or t.is_nested:
        raise CodecError(f"cannot encode a {t.layout} tensor", hint="convert it with .to_dense() first")
    if t.is_quantized:
        raise CodecError(f"cannot encode a quantized tensor ({t.dtype})", hint="log t.dequantize() or its int_repr()")
    if t.dtype not in _DTYPE_TO_CODE:
        raise CodecError(f"unsupported dtype {t.dtype}")
    t = t.detach().resolve_conj().resolve_neg()
    # Copy through a same-size integer view: sub-byte and bit dtypes have no copy kernel.
    carrier = _CARRIER.get(t.element_size())
    if carrier is not None and t.dtype != carrier:
        t = t.view(carrier)
    flat = t.contiguous().reshape(-1)
    if flat.numel() <= 1:  # "contiguous" with 0 or 1 element says nothing about the stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


def _hash_update(h: Any, arr: np.ndarray) -> None:
    for i in range(0, arr.nbytes, _HASH_CHUNK):
        h.update(arr[i : i + _HASH_CHUNK])


def _pieces(data: bytes | np.ndarray) -> list[bytes]:
    """``data`` as bytes objects of at most ``_PIECE`` bytes each (bytes pass through).

    ``bytes.join`` releases the GIL only when every item is a bytes object, and turning a numpy
    buffer into bytes holds it; small pieces keep both pauses short for other threads.
    """
    if isinstance(data, bytes):
        return [data]
    flat = data.reshape(-1).view(np.uint8)
    return [flat[i : i + _PIECE].tobytes() for i in range(0, flat.nbytes, _PIECE)]


# -- encode ------------------------------------------------------------------------------------


def encode_tensor(t: torch.Tensor, *, codec: str = "auto", level: int = 1) -> bytes:
    """Encode a CPU tensor into a self-describing blob (layout in the module docstring).

    ``codec`` is ``"auto"``, ``"raw"``, ``"zstd"`` or ``"planes"``; a forced codec is used even
    when it does not shrink the data (``planes`` still stores incompressible planes raw).
    ``level`` is the zstd level (``-131072..22``, 0 meaning zstd's default). Encodes the logical
    tensor in C order whatever its strides, conj/neg bits or ``requires_grad``; never modifies
    ``t`` and never keeps a reference to it. Raises TypeError for a non-tensor, ConfigError for a
    bad ``codec``/``level``, CodecError for a non-CPU, sparse, quantized or unsupported-dtype
    tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"encode_tensor expects a torch.Tensor, got {type(t).__name__}")
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}", hint=f"use one of {', '.join(CODECS)}")
    if not isinstance(level, int) or isinstance(level, bool) or not _MIN_LEVEL <= level <= _MAX_LEVEL:
        raise ConfigError(f"zstd level {level!r} out of range {_MIN_LEVEL}..{_MAX_LEVEL}")
    raw = _host_bytes(t)
    raw_len = raw.nbytes
    shape = tuple(t.shape)
    if len(shape) > 255:
        raise CodecError(f"tensor has {len(shape)} dimensions, the format holds at most 255")

    if codec == "auto":
        if raw_len < _TINY:
            codec = "raw"
        elif t.dtype in _FLOAT_WORD:
            codec = "planes"
        else:
            codec = "zstd"
        auto = True
    else:
        auto = False

    layout: _Layout | None = None
    if codec == "planes":
        layout, parts, digest = _encode_planes(raw, t.dtype, level)
        if auto and layout.stored_len >= raw_len:
            codec, layout, parts = "raw", None, _pieces(raw)
    else:
        h = xxhash.xxh3_64()
        _hash_update(h, raw)
        digest = h.intdigest()
        if codec == "zstd":
            frame = _zstd_compressor(level).compress(raw)
            if auto and len(frame) >= raw_len:
                codec, parts = "raw", _pieces(raw)
            else:
                parts = [frame]
        else:
            parts = _pieces(raw)

    payload_len = sum(map(len, parts))
    header = _pack_header(_DTYPE_TO_CODE[t.dtype], _CODEC_IDS[codec], shape, raw_len, payload_len, digest, layout)
    return b"".join([header, *parts])


def _pack_header(
    dtype_code: int,
    codec_id: int,
    shape: tuple[int, ...],
    raw_len: int,
    payload_len: int,
    digest: int,
    layout: _Layout | None,
) -> bytes:
    head = [_FIXED.pack(MAGIC, VERSION, dtype_code, codec_id, len(shape), raw_len, payload_len, digest)]
    head.append(struct.pack(f"<{len(shape)}Q", *shape))
    if layout is not None:
        head.append(_PLANES_HEAD.pack(layout.rotate, layout.word, len(layout.fields), layout.seg_words))
        head.extend(_FIELD.pack(off, width) for off, width in layout.fields)
        head.extend(_SEG_PLANE.pack(method, length) for seg in layout.segments for method, length in seg)
    body = b"".join(head)
    return body + _HCHECK.pack(xxhash.xxh3_64_intdigest(body))


def _plane_plan(dtype: torch.dtype) -> tuple[int, int, tuple[tuple[int, int, bool], ...]]:
    """(transform, word size, fields) of the planes codec for ``dtype``."""
    word = _FLOAT_WORD.get(dtype)
    if word is not None:
        return _ROT_LEFT1, word, _FLOAT_FIELDS[word]
    size = dtype.itemsize
    word = size if size in _UINT else 1
    return _ROT_NONE, word, tuple((o, 1, False) for o in reversed(range(word)))


def _encode_planes(raw: np.ndarray, dtype: torch.dtype, level: int) -> tuple[_Layout, list[bytes], int]:
    """Split ``raw`` into planes segment by segment; returns the layout, payload pieces, xxh3."""
    rotate, word, fields = _plane_plan(dtype)
    wt = _UINT[word]
    words = raw.view(wt)
    n = words.size
    bits = 8 * word
    seg = max(1, _SEGMENT_BYTES // word)
    chunk = max(1, _CHUNK_BYTES // word)
    buf = _scratch("planes", min(n, seg) * word)  # one segment's planes, back to back
    tmp = _scratch("enc_tmp", 2 * chunk * word)
    a_all, b_all = tmp[: chunk * word].view(wt), tmp[chunk * word :].view(wt)
    compress = _plane_coder(level)
    h = xxhash.xxh3_64()
    parts: list[bytes] = []
    segments: list[tuple[tuple[int, int], ...]] = []
    for s0 in range(0, n, seg):
        seg_words = words[s0 : s0 + seg]
        m = seg_words.size
        planes: list[np.ndarray] = []
        pos = 0
        for _, width, _ in fields:
            planes.append(buf[pos : pos + m * width].view(_UINT[width]))
            pos += m * width
        for c0 in range(0, m, chunk):
            src = seg_words[c0 : c0 + chunk]
            k = src.size
            h.update(src)
            for (off, _, _), plane in zip(fields, planes, strict=True):
                dst = plane[c0 : c0 + k]
                # Field (off, width) of rotl1(w) without materialising rotl1(w): for off > 0 it
                # is (w >> (8*off - 1)) cut to width; the field at offset 0 also takes the sign
                # bit. Casting to the narrower plane type truncates, dropping the high bits.
                if rotate == _ROT_NONE:
                    np.right_shift(src, 8 * off, out=dst, casting="unsafe")
                elif off:
                    np.right_shift(src, 8 * off - 1, out=dst, casting="unsafe")
                else:
                    a, b = a_all[:k], b_all[:k]
                    np.left_shift(src, 1, out=a)
                    np.right_shift(src, bits - 1, out=b)
                    np.bitwise_or(a, b, out=dst, casting="unsafe")
        stored_planes: list[tuple[int, int]] = []
        for (_, _, always), plane in zip(fields, planes, strict=True):
            data = plane.view(np.uint8)
            stored: bytes | np.ndarray = data
            method = _RAW
            if always or _sample_pays(data, compress):
                frame = compress(data)
                if len(frame) < data.nbytes:
                    stored, method = frame, _ZSTD
            parts.extend(_pieces(stored))  # copies out of the scratch before it is reused
            stored_planes.append((method, len(stored)))
        segments.append(tuple(stored_planes))
    layout = _Layout(rotate, word, seg, tuple((off, width) for off, width, _ in fields), tuple(segments))
    return layout, parts, h.intdigest()


def _sample_pays(data: np.ndarray, compress: _Coder) -> bool:
    """Whether a few spans of ``data`` compress by at least ``_SAMPLE_MIN_GAIN``."""
    if data.nbytes <= 4 * _SAMPLE_BYTES:
        return True  # small: just compress the whole plane
    span = _SAMPLE_BYTES // 4
    step = (data.nbytes - span) // 3
    sample = np.concatenate([data[k * step : k * step + span] for k in range(4)])
    return len(compress(sample)) <= (1.0 - _SAMPLE_MIN_GAIN) * sample.nbytes


# -- decode ------------------------------------------------------------------------------------


def _as_view(blob: Blob) -> memoryview:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, bytearray or memoryview, got {type(blob).__name__}")
    mv = memoryview(blob)
    if not mv.contiguous:
        raise CodecError("blob buffer is not contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _parse(mv: memoryview, key: object, total_length: int | None = None) -> tuple[TensorHeader, _Layout | None]:
    at = _where(key)
    size = mv.nbytes if total_length is None else total_length
    if size < 5 or mv.nbytes < 5 or bytes(mv[:4]) != MAGIC:
        raise CodecError(f"not a swiftlog tensor record: bad magic {bytes(mv[:4])!r}{at}", key=key)
    if mv[4] != VERSION:
        raise CodecError(f"unsupported tensor record version {mv[4]} (this build reads {VERSION}){at}", key=key)
    # the bytes at hand may be fewer than the length the index says (a truncated file)
    if min(size, mv.nbytes) < _FIXED.size + _HCHECK.size:
        raise CodecError(f"truncated tensor record: {min(size, mv.nbytes)} bytes, header alone needs more{at}", key=key)
    _, _, dtype_code, codec_id, ndim, raw_len, payload_len, digest = _FIXED.unpack_from(mv, 0)
    hlen = _FIXED.size + 8 * ndim
    if codec_id == _CODEC_IDS["planes"]:
        if min(size, mv.nbytes) < hlen + _PLANES_HEAD.size + _HCHECK.size:
            raise CodecError(f"truncated tensor record: {min(size, mv.nbytes)} bytes, header is longer{at}", key=key)
        _, word, nplanes, seg_words = _PLANES_HEAD.unpack_from(mv, hlen)
        if word not in _UINT or raw_len % word or (raw_len and not seg_words):
            raise CodecError(
                f"malformed planes header: word {word}, segment {seg_words} words, raw length {raw_len}{at}",
                key=key,
            )
        nseg = -(-(raw_len // word) // seg_words) if raw_len else 0
        hlen += _PLANES_HEAD.size + _FIELD.size * nplanes + _SEG_PLANE.size * nplanes * nseg
    hlen += _HCHECK.size
    if size < hlen:
        raise CodecError(f"truncated tensor record: {size} bytes, header needs {hlen}{at}", key=key)
    if mv.nbytes < hlen:
        raise CodecError(f"the first {mv.nbytes} bytes do not hold the {hlen}-byte header{at}", key=key)
    (hcheck,) = _HCHECK.unpack_from(mv, hlen - _HCHECK.size)
    if xxhash.xxh3_64_intdigest(mv[: hlen - _HCHECK.size]) != hcheck:
        raise CorruptRecordError(f"tensor record header checksum mismatch{at}", key=key)

    # The header is what was written; anything inconsistent now is a writer bug or a foreign blob.
    dtype = _CODE_TO_DTYPE.get(dtype_code)
    if dtype is None:
        raise CodecError(f"unknown dtype code {dtype_code} in tensor record{at}", key=key)
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        raise CodecError(f"unknown codec id {codec_id} in tensor record{at}", key=key)
    shape = struct.unpack_from(f"<{ndim}Q", mv, _FIXED.size)
    if any(d >= 1 << 63 for d in shape):
        raise CodecError(f"tensor record shape {shape} has a dimension beyond int64{at}", key=key)
    itemsize = dtype.itemsize
    if raw_len != math.prod(shape) * itemsize:
        raise CodecError(
            f"tensor record raw length {raw_len} does not match shape {shape} x {itemsize} bytes{at}", key=key
        )
    if size != hlen + payload_len:
        what = "truncated" if size < hlen + payload_len else "trailing bytes after"
        raise CodecError(f"{what} tensor record: {size} bytes, header says {hlen} + {payload_len} payload{at}", key=key)
    layout = None
    if codec == "raw" and payload_len != raw_len:
        raise CodecError(f"raw tensor record payload is {payload_len} bytes, expected {raw_len}{at}", key=key)
    if codec == "planes":
        layout = _parse_layout(mv, _FIXED.size + 8 * ndim, itemsize, raw_len, payload_len, at, key)
    header = TensorHeader(dtype, tuple(shape), codec, raw_len, payload_len, digest, hlen)
    return header, layout


def _parse_layout(
    mv: memoryview, pos: int, itemsize: int, raw_len: int, payload_len: int, at: str, key: object
) -> _Layout:
    rotate, word, nplanes, seg_words = _PLANES_HEAD.unpack_from(mv, pos)
    pos += _PLANES_HEAD.size
    fields = tuple(_FIELD.unpack_from(mv, pos + i * _FIELD.size) for i in range(nplanes))
    pos += _FIELD.size * nplanes
    n = raw_len // word
    segments = []
    for _ in range(0, n, seg_words) if n else ():
        segments.append(tuple(_SEG_PLANE.unpack_from(mv, pos + i * _SEG_PLANE.size) for i in range(nplanes)))
        pos += _SEG_PLANE.size * nplanes
    total = sum(length for seg in segments for _, length in seg)
    bad = None
    if rotate not in (_ROT_NONE, _ROT_LEFT1):
        bad = f"unknown plane transform {rotate}"
    elif itemsize % word:
        bad = f"plane word size {word} does not fit itemsize {itemsize}"
    elif not _tiles(fields, word):
        bad = f"planes {list(fields)} do not tile a {word}-byte word"
    elif total != payload_len:
        bad = f"plane lengths add up to {total}, payload is {payload_len}"
    else:
        for si, seg in enumerate(segments):
            m = min(seg_words, n - si * seg_words)
            for (method, length), (_, width) in zip(seg, fields, strict=True):
                if method not in (_RAW, _ZSTD):
                    bad = f"unknown plane method {method}"
                elif method == _RAW and length != m * width:
                    bad = f"raw plane of segment {si} is {length} bytes, expected {m * width}"
    if bad:
        raise CodecError(f"malformed planes header: {bad}{at}", key=key)
    return _Layout(rotate, word, seg_words, fields, tuple(segments))


def _tiles(fields: tuple[tuple[int, int], ...], word: int) -> bool:
    """Whether the (offset, width) fields cover the word exactly once."""
    end = 0
    for off, width in sorted(fields):
        if off != end or width not in _UINT:
            return False
        end += width
    return end == word


def _decompress(payload: memoryview, expected: int, what: str, key: object) -> bytes:
    at = _where(key)
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CorruptRecordError(f"corrupt {what} in tensor record{at}: {e}", key=key) from e
    if declared != expected:
        raise CorruptRecordError(
            f"corrupt {what} in tensor record{at}: frame declares {declared} bytes, expected {expected}", key=key
        )
    try:
        data = _zstd_decompressor().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise CorruptRecordError(f"corrupt {what} in tensor record{at}: {e}", key=key) from e
    if len(data) != expected:
        raise CorruptRecordError(
            f"corrupt {what} in tensor record{at}: {len(data)} bytes, expected {expected}", key=key
        )
    return data


def _decode(mv: memoryview, header: TensorHeader, layout: _Layout | None, key: object) -> torch.Tensor:
    out = torch.empty(header.raw_len, dtype=torch.uint8)
    out_np = out.numpy()
    payload = mv[header.header_len :]
    h = xxhash.xxh3_64()
    if header.codec == "planes":
        assert layout is not None
        _decode_planes(payload, layout, out_np, h, key)
    else:
        src = payload if header.codec == "raw" else _decompress(payload, header.raw_len, "zstd payload", key)
        src_np = np.frombuffer(src, dtype=np.uint8)
        for i in range(0, header.raw_len, _HASH_CHUNK):
            piece = out_np[i : i + _HASH_CHUNK]
            np.copyto(piece, src_np[i : i + _HASH_CHUNK])
            h.update(piece)
    if h.intdigest() != header.checksum:
        raise CorruptRecordError(
            f"checksum mismatch in tensor record{_where(key)}: stored {header.checksum:#018x}, "
            f"data {h.intdigest():#018x}",
            key=key,
            hint="the stored bytes are damaged; re-fetch the record from another tier or replica",
        )
    return out.view(header.dtype).reshape(header.shape)


def _decode_planes(payload: memoryview, layout: _Layout, out_np: np.ndarray, h: Any, key: object) -> None:
    word = layout.word
    wt = _UINT[word]
    words = out_np.view(wt)
    n = words.size
    bits = 8 * word
    rot = 1 if layout.rotate == _ROT_LEFT1 else 0
    chunk = max(1, _CHUNK_BYTES // word)
    tmp = _scratch("dec_tmp", chunk * word).view(wt)
    order = sorted(range(len(layout.fields)), key=lambda i: layout.fields[i][0])  # offset 0 first
    pos = 0
    for si, seg in enumerate(layout.segments):
        s0 = si * layout.seg_words
        m = min(layout.seg_words, n - s0)
        arrays: list[np.ndarray] = []
        for pi, ((method, length), (_, width)) in enumerate(zip(seg, layout.fields, strict=True)):
            stored = payload[pos : pos + length]
            pos += length
            data = stored if method == _RAW else _decompress(stored, m * width, f"segment {si} plane {pi}", key)
            arrays.append(np.frombuffer(data, dtype=_UINT[width], count=m))
        for c0 in range(0, m, chunk):
            o = words[s0 + c0 : s0 + c0 + chunk]
            k = o.size
            t = tmp[:k]
            for pi in order:
                off = layout.fields[pi][0]
                src = arrays[pi][c0 : c0 + k]
                # inverse of the encoder: undo rotl1 field by field (see _encode_planes)
                if off == 0:
                    np.right_shift(src, rot, out=o, dtype=wt)
                    if rot:
                        np.left_shift(src, bits - 1, out=t, dtype=wt)  # bit 0 back to the sign
                        np.bitwise_or(o, t, out=o)
                else:
                    np.left_shift(src, 8 * off - rot, out=t, dtype=wt)
                    np.bitwise_or(o, t, out=o)
            h.update(o)


def read_header(blob: Blob, *, key: object = None, total_length: int | None = None) -> TensorHeader:
    """Parse and check the header of a blob without decompressing or hashing the payload.

    ``total_length``: ``blob`` is only the first bytes (at least the header) of a record of that
    many bytes, e.g. the first chunk of a stream. Raises CodecError if the blob is not a
    well-formed record (bad magic/version, truncated, unknown dtype/codec, inconsistent lengths)
    and CorruptRecordError if the header's own checksum does not match. Says nothing about
    whether the payload is intact: use :func:`verify_blob`.
    """
    return _parse(_as_view(blob), key, total_length)[0]


def decode_tensor(blob: Blob, *, key: object = None) -> torch.Tensor:
    """Decode a blob into a fresh, contiguous CPU tensor that owns its memory.

    Verifies the xxh3_64 of the decoded bytes before returning; a mismatch or an undecodable
    compressed payload raises CorruptRecordError naming ``key``; a malformed blob raises
    CodecError. Never returns a tensor whose bytes differ from what was encoded, and never a view
    into ``blob``.
    """
    mv = _as_view(blob)
    header, layout = _parse(mv, key)
    return _decode(mv, header, layout, key)


def verify_blob(blob: Blob, *, key: object = None) -> TensorHeader:
    """Fully decode ``blob`` and check its checksum; return its header. Raises like decode_tensor."""
    mv = _as_view(blob)
    header, layout = _parse(mv, key)
    _decode(mv, header, layout, key)
    return header
