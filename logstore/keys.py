"""Record keys: what a logged tensor is, encoded so that byte order equals logical order.

A record is addressed by (run, channel, iteration, micro-batch, part). The run is a directory /
object prefix (validated by :func:`validate_run`); the rest is packed big-endian into
:data:`KEY_SIZE` bytes::

    kind u8 | src u16 | dst u16 | iteration u64 | micro_batch u32 | part u16

so every record of one channel is contiguous and ordered by (iteration, micro-batch, part):
"channel C, iterations [a, b)" is the single byte range ``[key(C, a, 0, 0), key(C, b, 0, 0))``.

Kinds (``Kind``):
- ACTIVATION  src -> dst = src + 1, what a stage sends forward (received by dst)
- GRADIENT    src -> dst = src - 1, what a stage sends backward (received by dst)
- INPUT       a stage's inputs from outside the pipeline (src = dst = stage): stage 0's batch, and
              any stage's keyword tensor inputs of the step (e.g. an attention mask)
- TARGET      the last stage's targets (src = dst = last stage)
- META        per-iteration metadata of one stage (src = dst = stage, micro-batch 0)
- DIGEST      small digests of what src sent to dst, kept to verify a replay of src

Retention follows :attr:`Channel.owner`: the stage whose durable checkpoint makes the record
garbage (the receiver for activations/gradients, the stage itself for the extra streams, the
sender for digests, since they exist to verify the sender's replay).
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass

from logstore.errors import InvalidKeyError, InvalidNameError

__all__ = [
    "Kind",
    "Channel",
    "RecordKey",
    "KEY_SIZE",
    "MAX_ITERATION",
    "validate_run",
    "validate_name",
    "channel_range",
]

_KEY = struct.Struct(">BHHQIH")
KEY_SIZE = _KEY.size  # 19
MAX_STAGE = 0xFFFF
MAX_ITERATION = 2**63 - 1
MAX_MICRO_BATCH = 0xFFFFFFFF
MAX_PART = 0xFFFF

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_name(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a safe single path component, else raise InvalidNameError.

    Allowed: 1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit, and no
    ``..``. Never touches the filesystem.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise InvalidNameError(
            f"invalid {what} {name!r}",
            hint="use 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'",
        )
    return name


def validate_run(run: object) -> str:
    """Validate a run id (a directory and object-prefix component)."""
    return validate_name(run, "run id")


class Kind(enum.IntEnum):
    ACTIVATION = 0
    GRADIENT = 1
    INPUT = 2
    TARGET = 3
    META = 4
    DIGEST = 5
    # a stage's gradients as a collective left them (client.all_reduce_grads_): one record per call, a part per
    # parameter
    REDUCED = 6

    @property
    def short(self) -> str:
        return _SHORT[self]


_SHORT = {
    Kind.ACTIVATION: "act",
    Kind.GRADIENT: "grad",
    Kind.INPUT: "input",
    Kind.TARGET: "target",
    Kind.META: "meta",
    Kind.DIGEST: "digest",
    Kind.REDUCED: "reduced",
}
_FROM_SHORT = {v: k for k, v in _SHORT.items()}
_OWN_KINDS = (Kind.INPUT, Kind.TARGET, Kind.META, Kind.REDUCED)  # channels of one stage: src == dst


@dataclass(frozen=True, slots=True, order=True)
class Channel:
    """A directed stream of records: (kind, src stage, dst stage).

    Ordering follows the key encoding (kind, src, dst). Construct with the helpers
    (:meth:`activation`, :meth:`gradient`, ...) which enforce the shape of each kind.
    """

    kind: Kind
    src: int
    dst: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        for field, v in (("src", self.src), ("dst", self.dst)):
            if not isinstance(v, int) or not 0 <= v <= MAX_STAGE:
                raise InvalidKeyError(f"channel {field} stage {v!r} out of range 0..{MAX_STAGE}")
        k = self.kind
        if k is Kind.ACTIVATION and self.dst != self.src + 1:
            raise InvalidKeyError(f"activation channel must go src -> src+1, got {self.src}->{self.dst}")
        if k is Kind.GRADIENT and self.dst != self.src - 1:
            raise InvalidKeyError(f"gradient channel must go src -> src-1, got {self.src}->{self.dst}")
        if k in _OWN_KINDS and self.src != self.dst:
            raise InvalidKeyError(f"{k.short} channel belongs to one stage, got {self.src}->{self.dst}")
        if k is Kind.DIGEST and abs(self.src - self.dst) != 1:
            raise InvalidKeyError(f"digest channel must join neighbours, got {self.src}->{self.dst}")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def activation(cls, src: int) -> Channel:
        return cls(Kind.ACTIVATION, src, src + 1)

    @classmethod
    def gradient(cls, src: int) -> Channel:
        return cls(Kind.GRADIENT, src, src - 1)

    @classmethod
    def input(cls, stage: int = 0) -> Channel:
        return cls(Kind.INPUT, stage, stage)

    @classmethod
    def target(cls, stage: int) -> Channel:
        return cls(Kind.TARGET, stage, stage)

    @classmethod
    def meta(cls, stage: int) -> Channel:
        return cls(Kind.META, stage, stage)

    @classmethod
    def digest(cls, src: int, dst: int) -> Channel:
        return cls(Kind.DIGEST, src, dst)

    @classmethod
    def reduced(cls, stage: int) -> Channel:
        return cls(Kind.REDUCED, stage, stage)

    # -- properties -----------------------------------------------------------------------
    @property
    def owner(self) -> int:
        """The stage whose durable checkpoint makes this channel's older records garbage."""
        if self.kind in (Kind.ACTIVATION, Kind.GRADIENT):
            return self.dst
        return self.src

    @property
    def sender(self) -> int:
        """The stage that produces the records (whose node writes them)."""
        return self.src

    @property
    def name(self) -> str:
        """Stable path-safe name, e.g. ``act_0_1``, ``grad_2_1``, ``input_0``, ``digest_1_2``."""
        if self.kind in _OWN_KINDS:
            return f"{self.kind.short}_{self.src}"
        return f"{self.kind.short}_{self.src}_{self.dst}"

    @classmethod
    def parse(cls, text: str) -> Channel:
        """Inverse of :attr:`name`; also accepts ``act:0->1`` style. Raises InvalidKeyError."""
        t = text.strip().replace("->", "_").replace(":", "_")
        parts = t.split("_")
        try:
            kind = _FROM_SHORT[parts[0]]
            nums = [int(p) for p in parts[1:]]
        except (KeyError, ValueError):
            raise InvalidKeyError(
                f"invalid channel {text!r}",
                hint="write e.g. act_0_1, grad_2_1, input_0, target_3, meta_2, digest_1_2 or reduced_0",
            ) from None
        if len(nums) == 1 and kind in _OWN_KINDS:
            return cls(kind, nums[0], nums[0])
        if len(nums) == 2:
            return cls(kind, nums[0], nums[1])
        raise InvalidKeyError(f"invalid channel {text!r}", hint="expected kind_src_dst or kind_stage")

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True, order=True)
class RecordKey:
    """(channel, iteration, micro-batch, part) within one run. ``part`` indexes tuple outputs."""

    channel: Channel
    iteration: int
    micro_batch: int = 0
    part: int = 0

    def __post_init__(self) -> None:
        for field, v, hi in (
            ("iteration", self.iteration, MAX_ITERATION),
            ("micro_batch", self.micro_batch, MAX_MICRO_BATCH),
            ("part", self.part, MAX_PART),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
                raise InvalidKeyError(f"record key {field} {v!r} out of range 0..{hi}")

    def encode(self) -> bytes:
        c = self.channel
        return _KEY.pack(c.kind, c.src, c.dst, self.iteration, self.micro_batch, self.part)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> RecordKey:
        if len(data) != KEY_SIZE:
            raise InvalidKeyError(f"encoded key must be {KEY_SIZE} bytes, got {len(data)}")
        kind, src, dst, it, mb, part = _KEY.unpack(bytes(data))
        try:
            ch = Channel(Kind(kind), src, dst)
        except ValueError as e:
            raise InvalidKeyError(f"encoded key has invalid channel: {e}") from e
        return cls(ch, it, mb, part)

    def __str__(self) -> str:
        return f"{self.channel.name}/it{self.iteration}/mb{self.micro_batch}/p{self.part}"

    @classmethod
    def parse(cls, text: str) -> RecordKey:
        """Inverse of ``str(key)``: ``act_0_1/it5/mb2/p0`` (mb and part optional)."""
        bits = text.strip().split("/")
        try:
            ch = Channel.parse(bits[0])
            nums = {}
            for b in bits[1:]:
                for prefix, field in (("it", "iteration"), ("mb", "micro_batch"), ("p", "part")):
                    if b.startswith(prefix) and b[len(prefix) :].isdigit():
                        nums[field] = int(b[len(prefix) :])
                        break
                else:
                    raise ValueError(b)
            return cls(ch, **nums)
        except (ValueError, TypeError) as e:
            if isinstance(e, InvalidKeyError):
                raise
            raise InvalidKeyError(f"invalid record key {text!r}", hint="write e.g. act_0_1/it5/mb2/p0") from None


def channel_range(channel: Channel, it_lo: int = 0, it_hi: int | None = None) -> tuple[bytes, bytes]:
    """Byte range ``[start, end)`` covering ``channel`` for iterations ``[it_lo, it_hi)``.

    ``it_hi=None`` means to the end of the channel.
    """
    start = RecordKey(channel, it_lo).encode()
    if it_hi is None:
        end = _KEY.pack(channel.kind, channel.src, channel.dst, MAX_ITERATION, MAX_MICRO_BATCH, MAX_PART) + b"\xff"
    else:
        end = RecordKey(channel, min(it_hi, MAX_ITERATION)).encode()
    return start, end
