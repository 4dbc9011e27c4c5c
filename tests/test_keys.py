"""Record keys: round trip, order preservation, channel ranges, name validation (property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore.errors import InvalidKeyError, InvalidNameError
from logstore.keys import KEY_SIZE, MAX_ITERATION, Channel, Kind, RecordKey, channel_range, validate_run

stages = st.integers(min_value=0, max_value=200)


@st.composite
def channels(draw: st.DrawFn) -> Channel:
    kind = draw(st.sampled_from(list(Kind)))
    s = draw(stages)
    if kind is Kind.ACTIVATION:
        return Channel.activation(s)
    if kind is Kind.GRADIENT:
        return Channel.gradient(s + 1)
    if kind is Kind.DIGEST:
        return Channel.digest(s, s + 1) if draw(st.booleans()) else Channel.digest(s + 1, s)
    return Channel(kind, s, s)


@st.composite
def record_keys(draw: st.DrawFn) -> RecordKey:
    return RecordKey(
        draw(channels()),
        draw(st.integers(0, MAX_ITERATION)),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 2**16 - 1)),
    )


@given(record_keys())
def test_encode_decode_roundtrip(k: RecordKey) -> None:
    b = k.encode()
    assert len(b) == KEY_SIZE
    assert RecordKey.decode(b) == k
    assert RecordKey.parse(str(k)) == k
    assert Channel.parse(k.channel.name) == k.channel


@settings(max_examples=300)
@given(record_keys(), record_keys())
def test_byte_order_equals_logical_order(a: RecordKey, b: RecordKey) -> None:
    ta = (a.channel.kind, a.channel.src, a.channel.dst, a.iteration, a.micro_batch, a.part)
    tb = (b.channel.kind, b.channel.src, b.channel.dst, b.iteration, b.micro_batch, b.part)
    assert (a.encode() < b.encode()) == (ta < tb)
    assert (a < b) == (ta < tb)


@given(record_keys(), st.integers(0, 10**6), st.integers(0, 10**6))
def test_channel_range_is_exactly_the_channel_iterations(k: RecordKey, lo: int, span: int) -> None:
    hi = lo + span
    start, end = channel_range(k.channel, lo, hi)
    inside = start <= k.encode() < end
    assert inside == (lo <= k.iteration < hi)
    # other channels never fall inside
    other = Channel.meta(k.channel.src + 1) if k.channel.kind is not Kind.META else Channel.input(k.channel.src + 1)
    assert not start <= RecordKey(other, k.iteration).encode() < end


def test_open_ended_range_covers_max_key() -> None:
    ch = Channel.activation(1)
    start, end = channel_range(ch, 5)
    assert start <= RecordKey(ch, MAX_ITERATION, 2**32 - 1, 2**16 - 1).encode() < end
    assert not start <= RecordKey(Channel.activation(2), 0).encode() < end


@pytest.mark.parametrize(
    "bad",
    ["", "..", "../x", "a/b", "/abs", "a..b", "x" * 129, "-lead", "sp ace", "nul\x00", "é"],
)
def test_bad_run_names_rejected(bad: str) -> None:
    with pytest.raises(InvalidNameError, match="invalid run id"):
        validate_run(bad)


def test_good_run_names() -> None:
    for good in ["run1", "gpt-2_small.v3", "A", "x" * 128]:
        assert validate_run(good) == good


@pytest.mark.parametrize(
    "make",
    [
        lambda: Channel(Kind.ACTIVATION, 1, 3),
        lambda: Channel(Kind.GRADIENT, 1, 2),
        lambda: Channel(Kind.INPUT, 0, 1),
        lambda: Channel(Kind.DIGEST, 0, 2),
        lambda: Channel(Kind.ACTIVATION, -1, 0),
        lambda: RecordKey(Channel.activation(0), -1),
        lambda: RecordKey(Channel.activation(0), 1, 2**32),
        lambda: RecordKey(Channel.activation(0), True),
        lambda: Channel.parse("bogus_1_2"),
        lambda: RecordKey.parse("act_0_1/itX"),
        lambda: RecordKey.decode(b"short"),
    ],
)
def test_invalid_keys_rejected(make) -> None:
    with pytest.raises(InvalidKeyError):
        make()


def test_owner_is_the_receiver_or_the_verified_sender() -> None:
    assert Channel.activation(1).owner == 2
    assert Channel.gradient(2).owner == 1
    assert Channel.input(0).owner == 0
    assert Channel.target(3).owner == 3
    assert Channel.meta(2).owner == 2
    assert Channel.digest(1, 2).owner == 1
