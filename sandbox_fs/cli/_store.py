"""``--store DIR|s3://BUCKET/PREFIX`` and ``--store-endpoint URL``: the snapshot store of run, session and snapshot.

A plain path is a local store directory (:class:`DirectorySnapshotStore`:
generations and layers, version-1 snapshots in it still restore; made 0700
when missing), taken by the host-path rule like every host path.
``s3://BUCKET[/PREFIX]`` is an :class:`S3SnapshotStore`: its endpoint is
``--store-endpoint`` or else the standard AWS chain (``AWS_ENDPOINT_URL_S3``
/ ``AWS_ENDPOINT_URL``, profiles), as are the region and the credentials
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` ...).  An S3 store is checked with one request when opened,
so a wrong endpoint, credential or bucket is one error line before anything
runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._errors import CliInputError
from ._hostpath import host_path

__all__ = ["add_endpoint_arg", "is_s3", "open_store", "client_store_options", "STORE_HELP"]

STORE_HELP = "snapshot store: a directory (created 0700 by a new session only) or s3://BUCKET/PREFIX"


def add_endpoint_arg(p: argparse.ArgumentParser) -> None:
    """Add ``--store-endpoint`` (the S3 endpoint URL of an ``s3://`` store)."""
    p.add_argument("--store-endpoint", metavar="URL", default=None,
                   help="S3 endpoint of an s3:// store (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL or AWS's)")


def is_s3(value: str | None) -> bool:
    """True for an ``s3://`` store."""
    return value is not None and value.startswith("s3://")


def _parse_s3(value: str) -> tuple[str, str]:
    bucket, _, prefix = value[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def open_store(args: argparse.Namespace, value: str | None, *, create: bool = True, keep: int = 2) -> Any:
    """The store ``value`` names, opened, or None when ``value`` is None.

    Opening a local store writes nothing in it (see
    :class:`~sandbox_fs.snapshot.DirectorySnapshotStore`); with ``create``
    False a missing directory is not made either.

    Args:
        args: the parsed options (``store_endpoint``, ``follow_host_symlinks``).
        value: the ``--store`` value.
        create: make a missing local directory (0700).
        keep: restore points the store keeps per name.

    Raises:
        CliInputError: ``--store-endpoint`` without an ``s3://`` store, or a
            bucket or prefix that is not valid.
        SnapshotStoreError: the S3 store cannot be reached (retryable), or
            its bucket is missing or the credentials are refused; or a local
            store directory is missing and ``create`` is False (not retryable).
        SymlinkRefusedError, OSError: a local directory cannot be opened (or made).
    """
    endpoint = getattr(args, "store_endpoint", None)
    if value is None or not is_s3(value):
        if endpoint is not None:
            raise CliInputError("--store-endpoint needs an s3://BUCKET/PREFIX store", sandbox_path=None)
        if value is None:
            return None
        from ..snapshot import DirectorySnapshotStore, SnapshotStoreError  # noqa: PLC0415

        try:
            return DirectorySnapshotStore(host_path(args, value), create=create, keep=keep)
        except FileNotFoundError:
            if create:
                raise
            raise SnapshotStoreError("the snapshot store directory does not exist (it is made only by a save)",
                                     sandbox_path=None, retryable=False) from None
    from ..snapshot import S3SnapshotStore  # noqa: PLC0415

    bucket, prefix = _parse_s3(value)
    try:
        return S3SnapshotStore(bucket, prefix, keep=keep, endpoint_url=endpoint, check=True)
    except ValueError as exc:
        raise CliInputError(f"the s3:// store is not valid: {exc}", sandbox_path=None) from None


def client_store_options(args: argparse.Namespace, value: str | None) -> dict[str, Any]:
    """The ``ClientOptions`` fields for store ``value``: ``snapshot_store`` (S3) or ``snapshot_dir`` (a directory).

    Raises:
        as :func:`open_store`.
    """
    if is_s3(value):
        return {"snapshot_store": open_store(args, value)}
    if getattr(args, "store_endpoint", None) is not None:
        raise CliInputError("--store-endpoint needs an s3://BUCKET/PREFIX store", sandbox_path=None)
    # the client makes (0700) and opens the directory by the host-path rule
    return {"snapshot_dir": host_path(args, value)}
