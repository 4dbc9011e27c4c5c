"""Test tooling shipped with the package: real loopback S3-compatible servers and fault injection.

Nothing here is imported by the log store itself; tests and benchmarks import it explicitly.
"""

from logstore.testing.s3servers import (
    MotoServer,
    S3Server,
    S3ServerError,
    SeaweedFSServer,
    free_port,
    seaweedfs_available,
    weed_binary,
)

__all__ = [
    "S3Server",
    "S3ServerError",
    "MotoServer",
    "SeaweedFSServer",
    "free_port",
    "seaweedfs_available",
    "weed_binary",
]
