"""Names in the cold tier: segment, document and prefix names, and the tier's URL.

Every name is a ``/``-separated relative path whose components are :func:`logstore.keys.validate_name`
names, so no name can reach outside the tier root.

Never: touches the filesystem or the network.
"""

from __future__ import annotations

import os
import re

from logstore.errors import ConfigError, InvalidNameError
from logstore.keys import validate_name

__all__ = [
    "MARKER_SUFFIX",
    "DOCS_PREFIX",
    "parse_cold_url",
    "validate_path",
    "validate_segment_name",
    "validate_prefix",
]

MARKER_SUFFIX = ".commit"
DOCS_PREFIX = "_docs/"  # "_" cannot start a valid name component, so docs never collide with segments
_MAX_NAME_LEN = 768  # S3 keys are at most 1024 bytes, leave room for the root prefix
_PREFIX_TAIL_RE = re.compile(r"^[A-Za-z0-9._-]*$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def validate_path(name: object, what: str) -> str:
    """A ``/``-joined relative path whose every component is a valid name."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError(
            f"invalid {what} {name!r}", hint="give a non-empty relative path like 'run/act_0_1/seg-0'"
        )
    if len(name) > _MAX_NAME_LEN:
        raise InvalidNameError(f"invalid {what}: {len(name)} characters, at most {_MAX_NAME_LEN}")
    for part in name.split("/"):
        try:
            validate_name(part, "path component")
        except InvalidNameError as e:
            raise InvalidNameError(
                f"invalid {what} {name!r}: component {part!r} is not allowed "
                "(no empty components, no absolute paths, no '..')",
                hint=e.hint,
            ) from None
    return name


def validate_segment_name(name: object) -> str:
    name = validate_path(name, "segment name")
    if name.endswith(MARKER_SUFFIX):
        raise InvalidNameError(
            f"invalid segment name {name!r}: the suffix {MARKER_SUFFIX!r} is reserved for commit markers"
        )
    return name


def validate_prefix(prefix: object) -> str:
    """A listing prefix: complete valid components, then an optional partial last component."""
    if not isinstance(prefix, str):
        raise InvalidNameError(f"invalid prefix {prefix!r}: must be a string")
    if prefix == "":
        return prefix
    head, sep, tail = prefix.rpartition("/")
    if sep:
        validate_path(head, "prefix")  # also rejects a leading '/' (empty first component)
    if not _PREFIX_TAIL_RE.match(tail) or ".." in tail or (tail and not tail[0].isalnum()):
        raise InvalidNameError(f"invalid prefix {prefix!r}: last component {tail!r} is not allowed")
    return prefix


def parse_cold_url(url: object) -> tuple[str, str, str]:
    """A cold tier URL as (scheme, where, prefix): ``("file", "/abs/dir", "")`` or ``("s3", bucket, prefix)``.

    A plain path is a ``file://`` directory. Raises ConfigError naming the URL for anything else:
    a scheme without ``://`` (``s3:/bucket``), a relative ``file://`` path, an invalid bucket or
    prefix, an unsupported scheme. Never touches the filesystem or the network.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"cold tier url {url!r} is not a non-empty string", hint="e.g. file:///data/cold or s3://bucket/prefix"
        )
    scheme, sep, rest = url.partition("://")
    if not sep:
        # "s3:/bucket", "file:/dir": a URL with a typo, not a directory named "s3:"
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", url):
            raise ConfigError(
                f"cold tier url {url!r} is not a URL (scheme without '://') nor a plain path",
                hint="write s3://bucket/prefix or file:///abs/dir",
            )
        scheme, rest = "file", os.path.abspath(url)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise ConfigError(f"cold tier url {url!r}: file:// needs an absolute path", hint="write file:///abs/dir")
        return "file", os.path.normpath(rest), ""
    if scheme in ("s3", "s3a"):
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET_RE.match(bucket):
            raise ConfigError(f"cold tier url {url!r}: {bucket!r} is not a valid bucket name")
        if prefix:
            try:
                validate_path(prefix, "cold tier prefix")
            except InvalidNameError as e:
                raise ConfigError(f"cold tier url {url!r}: {e}") from None
        return "s3", bucket, prefix
    raise ConfigError(f"cold tier url {url!r}: scheme {scheme!r} not supported", hint="use file:// or s3://")
