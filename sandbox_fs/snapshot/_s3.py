"""The object contract (:mod:`._objects`) over an S3-compatible bucket: :class:`S3Objects` (boto3).

Keys are stored under ``<prefix>/`` in one bucket.  What each contract
operation becomes:

- :meth:`S3Objects.put_stream`: data is buffered up to one part; an object
  that stays under one part is a single ``PutObject`` at commit, a larger one
  a multipart upload whose parts are sent by at most ``upload_threads``
  threads while the caller keeps writing.  Memory is bounded by
  ``(upload_threads + 2) * part size`` (the part being filled, one queued,
  one per thread in flight).  The size is not known in advance, so
  the part size grows: parts ``900 * k + 1 .. 900 * (k + 1)`` are
  ``part_size * 2**k`` bytes (capped at 5 GiB), which reaches S3's largest
  object (5 TiB) within S3's 10,000-part limit for any ``part_size`` of at
  least 5 MiB (doubling every 1000 parts would fall short from 5 MiB).  Nothing is visible before ``CompleteMultipartUpload``.
- :meth:`S3Objects.put_bytes`: ``PutObject`` with ``If-Match`` /
  ``If-None-Match: *`` (RFC 9110 §13.1.1-2 conditional requests, which S3
  and SeaweedFS evaluate atomically on the server); ``412 Precondition
  Failed`` or ``409 ConditionalRequestConflict`` is
  :class:`SnapshotConflictError`.
- :meth:`S3Objects.open_range`: ranged ``GetObject`` of at most one part
  size each; the first is fetched at once (it gives the object's size and
  ETag), the rest by up to ``read_threads`` threads at once, ahead of the
  caller and handed over in order, every one sent with ``If-Match`` of the
  first one's ETag, so a reader never mixes two versions of an object.
  Memory is bounded by ``(read_threads + 1) * part size`` for the reader
  being read, one part size for one opened and not yet read.
- :meth:`S3Objects.get_bytes`: one ``GetObject``.
- Every GET whose body the connection drops part way is asked for again
  from the byte it reached (``Range`` from there, ``If-Match`` of the ETag
  it began with), at most :data:`BODY_RESUMES` times; each answer must
  start exactly at the byte asked for (its ``Content-Range``), so no byte
  is read twice or skipped.  (botocore retries a request that fails before
  its response arrives, never a body that breaks while it is read.)
- :meth:`S3Objects.abort_stale_uploads`: ``ListMultipartUploads`` and
  ``AbortMultipartUpload`` of those initiated before the cutoff.

Errors: connection failures, timeouts, 5xx, throttling and a body the
connection kept dropping are :class:`SnapshotStoreError` with ``retryable=True``; missing credentials,
refused credentials, access denied and a missing bucket the same class with
``retryable=False``.  Messages and contexts carry the S3 error code and the
key, never a credential (they are also redacted) or the endpoint's userinfo.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import io
import queue
import re
import threading
import time
from typing import IO, Any, Iterator

from ._errors import SnapshotConflictError, SnapshotLimitError, SnapshotNotFoundError, SnapshotStoreError
from ._generations import GenerationStore
from ._objects import ObjectInfo
from ._objects_local import validate_key

__all__ = ["S3Objects", "S3Options", "S3SnapshotStore", "MIN_PART_SIZE", "MAX_PARTS"]

#: S3's smallest part (all but the last), in bytes.
MIN_PART_SIZE = 5 << 20
#: S3's largest part, in bytes.
MAX_PART_SIZE = 5 << 30
#: S3's most parts in one multipart upload.
MAX_PARTS = 10_000
_PARTS_PER_SIZE = 900
#: times one GET's body, dropped by the connection part way, is asked for again from the byte it reached
BODY_RESUMES = 3
_READ_PIECE = 1 << 20  # bytes asked of a response body at a time
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3 bucket naming rules (general purpose buckets)
_PREFIX = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,254})(/[A-Za-z0-9][A-Za-z0-9._-]{0,254})*")

_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_PERMANENT_CODES = {
    "NoSuchBucket": "the bucket does not exist",
    "InvalidAccessKeyId": "the store does not know the access key",
    "SignatureDoesNotMatch": "the store refused the credentials (signature does not match)",
    "AccessDenied": "the store denied access",
    "InvalidToken": "the store refused the session token",
    "ExpiredToken": "the session token has expired",
    "TokenRefreshRequired": "the session token has expired",
    "AllAccessDisabled": "the store denied access",
    "InvalidBucketName": "the bucket name is not valid",
    "403": "the store denied access",
}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}


def part_size_for(part_number: int, part_size: int) -> int:
    """The size of part ``part_number`` (1-based) of an upload of unknown size, in bytes.

    ``part_size`` doubles every 900 parts, capped at :data:`MAX_PART_SIZE`;
    with ``part_size >= MIN_PART_SIZE``, parts 1..10,000 hold more than 5 TiB.
    """
    return min(MAX_PART_SIZE, part_size << ((part_number - 1) // _PARTS_PER_SIZE))


def _check_endpoint(url: object) -> None:
    """Refuse an endpoint that is not ``http(s)://HOST[:PORT][/PATH]``, without repeating it (it may hold a secret)."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    ok = False
    if isinstance(url, str) and not any(c.isspace() or ord(c) < 32 for c in url):
        try:
            parts = urlsplit(url)
            _ = parts.port  # ValueError: a port that is no number or out of range
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # a bad IPv6 literal, a bad port
            ok = False
    if not ok:
        raise ValueError("the S3 endpoint must be an http:// or https:// URL with a host")


#: Longest store prefix, in characters (S3 keys are at most 1024 bytes, and the store's keys go under it).
MAX_PREFIX_CHARS = 512


class S3Options:
    """How to reach the bucket: endpoint, credentials and client limits.

    Every field left None comes from the standard AWS configuration chain
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
    ``AWS_PROFILE``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``~/.aws/config`` and
    ``~/.aws/credentials``, instance metadata ...), as boto3 resolves it.

    Args:
        endpoint_url: e.g. ``"http://127.0.0.1:8333"``; path-style addressing is used with it.
        region_name: the signing region (``"us-east-1"`` when neither this nor the chain gives one).
        profile_name: a profile of the AWS config files.
        aws_access_key_id, aws_secret_access_key, aws_session_token: explicit credentials.
        part_size: first part size of multipart uploads and the size of each ranged GET,
            in bytes (>= 5 MiB; default 8 MiB).
        upload_threads: parts sent at once by one upload (>= 1; default 2).
        read_threads: ranged GETs in flight at once for one reader of
            :meth:`S3Objects.open_range` (>= 1; default 3).
        connect_timeout, read_timeout: seconds (defaults 5 and 60).
        max_attempts: attempts per request, including the first (botocore's
            standard retry mode; default 3).

    Raises:
        ValueError: ``endpoint_url`` is not an ``http://`` or ``https://`` URL
            with a host (the message does not repeat it), or ``part_size``,
            ``upload_threads``, ``read_threads`` or ``max_attempts`` out of range.
    """

    def __init__(self, *, endpoint_url: str | None = None, region_name: str | None = None,
                 profile_name: str | None = None, aws_access_key_id: str | None = None,
                 aws_secret_access_key: str | None = None, aws_session_token: str | None = None,
                 part_size: int = 8 << 20, upload_threads: int = 2, read_threads: int = 3,
                 connect_timeout: float = 5.0, read_timeout: float = 60.0, max_attempts: int = 3) -> None:
        if endpoint_url is not None:
            _check_endpoint(endpoint_url)
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError("part_size must be between 5 MiB and 5 GiB")
        if upload_threads < 1 or read_threads < 1 or max_attempts < 1:
            raise ValueError("upload_threads, read_threads and max_attempts must be >= 1")
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.profile_name = profile_name
        self.aws_access_key_id = aws_access_key_id
        self.aws_secret_access_key = aws_secret_access_key
        self.aws_session_token = aws_session_token
        self.part_size = part_size
        self.upload_threads = upload_threads
        self.read_threads = read_threads
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_attempts = max_attempts

    def __repr__(self) -> str:  # never shows a credential
        return f"S3Options(endpoint_url={self.endpoint_url!r}, region_name={self.region_name!r})"


def _config_hint(exc: BaseException) -> str:
    """What to check when making the client failed with ``exc`` (never its text: it may repeat a secret)."""
    from botocore.exceptions import (ConfigParseError, CredentialRetrievalError, NoCredentialsError,  # noqa: PLC0415
                                     PartialCredentialsError, ProfileNotFound)

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return "no usable credentials were found"
    if isinstance(exc, (ProfileNotFound, ConfigParseError)):
        return "the AWS profile or configuration file could not be read"
    return "is the endpoint an http:// or https:// URL with a host?"


def _make_client(options: S3Options) -> tuple[Any, tuple[str, ...]]:
    """A boto3 S3 client for ``options`` and the credential strings to redact from errors."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError:
        raise SnapshotStoreError("the S3 store needs boto3 (install sandbox-fs[s3])", sandbox_path=None,
                                 context={"error": "ImportError"}, retryable=False) from None

    try:
        session = boto3.session.Session(profile_name=options.profile_name,
                                        aws_access_key_id=options.aws_access_key_id,
                                        aws_secret_access_key=options.aws_secret_access_key,
                                        aws_session_token=options.aws_session_token,
                                        region_name=options.region_name)
        config = Config(connect_timeout=options.connect_timeout, read_timeout=options.read_timeout,
                        retries={"max_attempts": options.max_attempts, "mode": "standard"},
                        # every thread of an upload and a reader at once keeps its connection (no new
                        # TCP connection per part); keepalive finds a connection dropped while idle
                        max_pool_connections=max(10, 2 * (options.upload_threads + options.read_threads) + 2),
                        tcp_keepalive=True,
                        s3={"addressing_style": "path"} if options.endpoint_url else None)
        client = session.client("s3", endpoint_url=options.endpoint_url,
                                region_name=session.region_name or "us-east-1", config=config)
        creds = session.get_credentials()
    except (BotoCoreError, ValueError) as exc:
        # botocore's text repeats what it refused (an endpoint from AWS_ENDPOINT_URL_S3 or a
        # config file, credentials in it included: "Invalid endpoint: USER:PASS@..."): only its type
        raise SnapshotStoreError(f"the S3 client could not be configured ({_config_hint(exc)})", sandbox_path=None,
                                 context={"error": type(exc).__name__}, retryable=False) from None
    secrets: list[str] = [s for s in (options.aws_secret_access_key, options.aws_session_token) if s]
    if creds is not None:
        frozen = creds.get_frozen_credentials()
        secrets += [s for s in (frozen.secret_key, frozen.token) if s]
    return client, tuple(secrets)


class _Errors:
    """Turns botocore exceptions into the contract's errors, redacting the credentials."""

    def __init__(self, secrets: tuple[str, ...]) -> None:
        self.secrets = secrets

    def store(self, reason: str, key: str | None, context: dict[str, Any], retryable: bool) -> SnapshotStoreError:
        if key is not None:
            context = {**context, "key": key}
        return SnapshotStoreError(reason, sandbox_path=None, context=context, retryable=retryable,
                                  secrets=self.secrets)

    def translate(self, exc: BaseException, key: str | None, doing: str) -> Exception:
        """The contract error for ``exc`` raised while ``doing`` (a verb phrase) on ``key``."""
        from botocore.exceptions import (ClientError, ConnectionError, HTTPClientError, IncompleteReadError,
                                         NoCredentialsError, PartialCredentialsError, CredentialRetrievalError,
                                         BotoCoreError)

        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            ctx = {"error": code or str(status), "status": status}
            if code in _CONFLICT_CODES or status == 412:
                return SnapshotConflictError("the object changed since it was read (conditional write refused)",
                                             sandbox_path=None, context={"key": key})
            if code in _MISSING_CODES:
                return SnapshotNotFoundError("no such object", sandbox_path=None, context={"key": key})
            if code in _PERMANENT_CODES:
                return self.store(f"{doing} failed: {_PERMANENT_CODES[code]}", key, ctx, False)
            if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                return self.store(f"{doing} failed: the store is unavailable", key, ctx, True)
            return self.store(f"{doing} failed: the store refused the request", key, ctx, False)
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
            return self.store(f"{doing} failed: no usable credentials were found", key,
                              {"error": type(exc).__name__}, False)
        if isinstance(exc, (ConnectionError, HTTPClientError)):
            return self.store(f"{doing} failed: the store could not be reached", key,
                              {"error": type(exc).__name__}, True)
        if isinstance(exc, BotoCoreError) and not isinstance(exc, IncompleteReadError):
            return self.store(f"{doing} failed", key, {"error": type(exc).__name__}, False)
        if isinstance(exc, (OSError, IncompleteReadError)):  # a socket error while reading a body, or its early end
            return self.store(f"{doing} failed: the connection broke", key, {"error": type(exc).__name__}, True)
        return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


def _strip(etag: str) -> str:
    return etag.strip('"')


def _mtime(value: Any) -> float:
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return time.time()


def _server_time(response: Any) -> float:
    """The server's time a response was sent, from its ``Date`` header; the local time without one.

    ``Date`` has whole seconds: the end of its second is taken (at most 1 s
    later than the server's clock, so an age of 0 covers every upload begun).
    """
    try:
        date = response["ResponseMetadata"]["HTTPHeaders"]["date"]
        return email.utils.parsedate_to_datetime(date).timestamp() + 1.0
    except (KeyError, TypeError, ValueError, IndexError):
        return time.time()


class _S3Writer:
    """A streaming upload of one object: one PutObject, or a multipart upload once a part is full."""

    def __init__(self, store: S3Objects, key: str) -> None:
        self._store = store
        self.key = key
        self._buf = bytearray()
        self._count = 0
        self._upload_id: str | None = None
        self._parts: dict[int, str] = {}
        self._next_part = 1
        self._pending: queue.Queue[tuple[int, bytearray] | None] | None = None
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._done = False
        self._lock = threading.Lock()

    def _limit(self) -> int:
        return part_size_for(self._next_part, self._store.options.part_size)

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; returns ``len(data)``.  Raises :class:`SnapshotStoreError`."""
        if self._done:
            raise self._store._errors.store("write after the upload finished", self.key, {}, False)
        self._raise_pending()
        view = memoryview(data).cast("B")
        total = len(view)
        off = 0
        while off < total:
            room = self._limit() - len(self._buf)
            take = min(room, total - off)
            self._buf += view[off:off + take]
            off += take
            if len(self._buf) >= self._limit():
                self._send_part()
        self._count += total
        return total

    def _raise_pending(self) -> None:
        if self._error is not None:
            err = self._error
            self.abort()
            raise self._store._errors.translate(err, self.key, "uploading a part")

    def _start(self) -> None:
        client = self._store._client
        try:
            resp = client.create_multipart_upload(Bucket=self._store.bucket, Key=self._store._full(self.key))
        except Exception as exc:
            raise self._store._errors.translate(exc, self.key, "starting the upload") from None
        self._upload_id = str(resp["UploadId"])
        threads = self._store.options.upload_threads
        self._pending = queue.Queue(maxsize=1)  # with the threads' parts in flight: memory bound
        for i in range(threads):
            t = threading.Thread(target=self._upload_loop, name=f"sfs-s3-upload-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _send_part(self) -> None:
        if self._next_part > MAX_PARTS:
            self.abort()
            raise self._store._errors.store("the object needs more than 10,000 parts", self.key, {}, False)
        if self._upload_id is None:
            self._start()
        assert self._pending is not None
        data, self._buf = self._buf, bytearray()  # handed over, not copied
        number = self._next_part
        self._next_part += 1
        while True:
            self._raise_pending()
            try:
                self._pending.put((number, data), timeout=0.5)
                return
            except queue.Full:
                continue

    def _upload_loop(self) -> None:
        assert self._pending is not None
        client = self._store._client
        while True:
            item = self._pending.get()
            if item is None:
                return
            number, data = item
            if self._error is not None:
                continue
            try:
                resp = client.upload_part(Bucket=self._store.bucket, Key=self._store._full(self.key),
                                          UploadId=self._upload_id, PartNumber=number, Body=data)
                with self._lock:
                    self._parts[number] = str(resp["ETag"])
            except BaseException as exc:  # reported to the writer's thread by _raise_pending
                self._error = exc

    def _drain(self) -> None:
        if self._pending is not None:
            for _ in self._threads:
                self._pending.put(None)
            for t in self._threads:
                t.join()
            self._pending = None
            self._threads = []

    def commit(self) -> ObjectInfo:
        """Send what is left and make the object visible.  Raises :class:`SnapshotStoreError`."""
        if self._done:
            raise self._store._errors.store("the upload already finished", self.key, {}, False)
        store = self._store
        full = store._full(self.key)
        try:
            if self._upload_id is None:
                resp = store._client.put_object(Bucket=store.bucket, Key=full, Body=bytes(self._buf))
                etag = str(resp["ETag"])
            else:
                if self._buf or self._next_part == 1:
                    self._send_part()
                self._drain()
                self._raise_pending()
                parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._parts.items())]
                resp = store._client.complete_multipart_upload(
                    Bucket=store.bucket, Key=full, UploadId=self._upload_id, MultipartUpload={"Parts": parts})
                etag = str(resp["ETag"])
                self._upload_id = None
        except SnapshotStoreError:
            self.abort()
            raise
        except Exception as exc:
            self.abort()
            raise store._errors.translate(exc, self.key, "committing the object") from None
        self._done = True
        self._buf = bytearray()
        return ObjectInfo(self.key, self._count, _strip(etag), time.time())

    def abort(self) -> None:
        """Discard the upload (its multipart upload is aborted); idempotent, never raises."""
        self._done = True
        self._buf = bytearray()
        if self._pending is not None:
            with contextlib.suppress(Exception):
                while True:
                    self._pending.get_nowait()
            self._drain()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self._store._client.abort_multipart_upload(Bucket=self._store.bucket,
                                                           Key=self._store._full(self.key), UploadId=upload_id)


class _RangeReader(io.RawIOBase):
    """Reads ``[start, end)`` of one object version through ranged GETs of one part size each.

    :meth:`begin` fetches the first range in the caller's thread: it gives
    the object's ETag and size (``end`` is cut to the size, so no request
    is made past the end).  From the caller's first read on, up to
    ``read_threads`` threads (``sfs-s3-read``) fetch the following ranges,
    at most ``read_threads`` ahead of the one the caller reads, each sent
    with ``If-Match`` of the first one's ETag; the caller takes them in
    order, so the network and the caller's work (hydrate's extraction)
    overlap.  Memory: one range until the first read (a chain's readers are
    all opened before the first is read), then at most ``read_threads + 1``.
    A failure of any range is raised to the caller when it reaches that range.
    """

    def __init__(self, store: S3Objects, key: str, start: int, end: int | None) -> None:
        self._store = store
        self._key = key
        self._start = start
        self._end = end  # None: to the end of the object (known after the first GET)
        self._total: int | None = None  # the object's size, as the first GET gave it
        self._step = store.options.part_size
        self._window = store.options.read_threads
        self._etag: str | None = None
        self._count = 0  # ranges in [start, end)
        self._cond = threading.Condition()
        self._ready: dict[int, bytearray | BaseException] = {}
        self._next_fetch = 1  # the next range a thread takes (range 0 is begin's)
        self._next_read = 1  # the next range the caller takes
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._buf = memoryview(b"")
        self._eof = False
        self._started = False

    def readable(self) -> bool:
        return True

    def begin(self) -> None:
        """Fetch the first range and start the threads (a missing object or a refused request raises here)."""
        end = self._end
        last = self._start + self._step - 1 if end is None else min(end, self._start + self._step) - 1
        data, self._etag, total = self._store._get_span(self._key, self._start, last, None)
        self._total = total
        if total is None:  # InvalidRange: start is at or past the end of the object
            end = self._start
        else:
            end = total if end is None else min(end, total)
        self._end = max(end, self._start)
        self._count = -(-(self._end - self._start) // self._step)
        if self._count > 1 and self._etag is None:  # the later ranges could not be tied to this version
            raise self._store._errors.store("the object changed while it was read", self._key,
                                            {"error": "no ETag"}, True)
        self._buf = memoryview(data)

    def _start_threads(self) -> None:
        """Start fetching ahead (at the first read)."""
        self._started = True
        for i in range(min(self._window, self._count - 1)):
            t = threading.Thread(target=self._fetch_loop, name=f"sfs-s3-read-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _take_index(self) -> int | None:
        """The next range for a thread to fetch (None: none left, or stopped), within the window."""
        with self._cond:
            while not self._stopped and self._next_fetch < self._count \
                    and self._next_fetch - self._next_read >= self._window:
                self._cond.wait()
            if self._stopped or self._next_fetch >= self._count:
                return None
            self._next_fetch += 1
            return self._next_fetch - 1

    def _fetch_loop(self) -> None:
        assert self._end is not None
        while (i := self._take_index()) is not None:
            pos = self._start + i * self._step
            last = min(self._end, pos + self._step) - 1
            item: bytearray | BaseException
            try:
                item, _etag, total = self._store._get_span(self._key, pos, last, self._etag)
                if len(item) != last - pos + 1 or total != self._total:  # another size than the first answer's
                    raise self._store._errors.store("the object changed while it was read", self._key,
                                                    {"error": "short read"}, True)
            except BaseException as exc:  # raised in the reader's thread by _next
                item = exc
            with self._cond:
                self._ready[i] = item
                if isinstance(item, BaseException):
                    self._stopped = True  # nothing after a failed range is needed
                self._cond.notify_all()

    def _next(self) -> None:
        with self._cond:
            if self._next_read >= self._count:
                self._eof = True
                self._buf = memoryview(b"")
                return
            while self._next_read not in self._ready:
                self._cond.wait()
            item = self._ready.pop(self._next_read)
            self._next_read += 1
            self._cond.notify_all()
        if isinstance(item, BaseException):
            self._eof = True
            raise item
        self._buf = memoryview(item)

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        if not len(view):
            return 0
        if not self._started:
            self._start_threads()
        while not len(self._buf):
            if self._eof:
                return 0
            self._next()
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            with self._cond:
                self._stopped = True
                self._ready.clear()
                self._cond.notify_all()
            for t in self._threads:
                t.join()
            self._ready.clear()
            self._buf = memoryview(b"")
        super().close()


def _content_range(resp: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(first, last, size)`` from a ``Content-Range: bytes first-last/size`` header (None: absent or not so)."""
    m = _CONTENT_RANGE.fullmatch(str(resp.get("ContentRange") or "").strip())
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def _body_errors() -> tuple[type[BaseException], ...]:
    """What reading a response body raises when the connection breaks or ends early."""
    import http.client

    from botocore.exceptions import HTTPClientError, IncompleteReadError
    from urllib3.exceptions import HTTPError

    return OSError, http.client.HTTPException, HTTPError, HTTPClientError, IncompleteReadError


class S3Objects:
    """Objects in one S3 bucket under a key prefix: :class:`~sandbox_fs.snapshot.ObjectStore` over boto3.

    See the module docstring for how each operation maps onto S3.  Safe to
    use from several threads at once (one boto3 client, which is).

    Args:
        bucket: the bucket name (S3 naming rules: 3-63 of ``a-z0-9.-``).
        prefix: ``/``-separated key prefix the store keeps everything under
            (components as object keys, :func:`validate_key`), or ``""``.
        options: endpoint, credentials and limits (:class:`S3Options`);
            None for the standard AWS chain and the defaults.
        client: an already-made boto3 S3 client to use instead (tests, hosts
            with their own session); ``options`` then only gives the limits.

    Raises:
        ValueError: ``bucket`` or ``prefix`` is not valid (``prefix`` over
            :data:`MAX_PREFIX_CHARS`, or a component that is no plain name).
        SnapshotStoreError: the client could not be configured (non-retryable).
    """

    def __init__(self, bucket: str, prefix: str = "", *, options: S3Options | None = None,
                 client: Any = None) -> None:
        if not _BUCKET.fullmatch(bucket):
            raise ValueError("bucket name must be 3-63 characters of a-z 0-9 . -")
        prefix = prefix.strip("/")
        if len(prefix) > MAX_PREFIX_CHARS:
            raise ValueError(f"the prefix is too long (at most {MAX_PREFIX_CHARS} characters)")
        if prefix and not _PREFIX.fullmatch(prefix):
            raise ValueError("prefix components must be plain names (letters, digits, . _ -, not leading .)")
        self.bucket = bucket
        self.prefix = prefix
        self.options = options or S3Options()
        if client is None:
            self._client, secrets = _make_client(self.options)
        else:
            self._client, secrets = client, ()
        self._errors = _Errors(secrets)
        self._closed = False

    def __repr__(self) -> str:
        return f"<S3Objects s3://{self.bucket}/{self.prefix}>"

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        """Make one request (``HeadBucket``) so a bad endpoint, credential or bucket fails now.

        Raises:
            SnapshotStoreError: the bucket cannot be reached (retryable) or is
                missing or refused (not retryable).
        """
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            from botocore.exceptions import ClientError
            if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
                raise self._errors.store("the bucket does not exist", None, {"error": "NoSuchBucket"},
                                         False) from None
            raise self._errors.translate(exc, None, "reaching the bucket") from None

    # -- writing

    def put_stream(self, key: str) -> _S3Writer:
        """Start a streaming upload of ``key`` (replaces an existing object at commit).

        Raises:
            ValueError: ``key`` is not a valid key.
        """
        validate_key(key)
        return _S3Writer(self, key)

    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None,
                  if_none_match: bool = False) -> ObjectInfo:
        """One ``PutObject``, conditional with ``If-Match`` / ``If-None-Match: *``.

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotConflictError: the condition did not hold.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key), "Body": bytes(data)}
        if if_match is not None:
            args["IfMatch"] = f'"{_strip(if_match)}"'
        if if_none_match:
            args["IfNoneMatch"] = "*"
        try:
            resp = self._client.put_object(**args)
        except Exception as exc:
            err = self._errors.translate(exc, key, "writing the object")
            if isinstance(err, SnapshotNotFoundError):  # If-Match on a missing key answers 404 on some servers
                err = SnapshotConflictError("the object does not exist (conditional write refused)",
                                            sandbox_path=None, context={"key": key})
            raise err from None
        return ObjectInfo(key, len(data), _strip(str(resp["ETag"])), time.time())

    def delete(self, key: str) -> None:
        """``DeleteObject`` (a missing key is no error).

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as exc:
            err = self._errors.translate(exc, key, "deleting the object")
            if not isinstance(err, SnapshotNotFoundError):
                raise err from None

    # -- reading

    def head(self, key: str) -> ObjectInfo | None:
        """``HeadObject``: the object's info, or None when it does not exist.

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as exc:
            err = self._errors.translate(exc, key, "reading the object")
            if isinstance(err, SnapshotNotFoundError):
                return None
            raise err from None
        return ObjectInfo(key, int(resp["ContentLength"]), _strip(str(resp["ETag"])), _mtime(resp.get("LastModified")))

    def open_range(self, key: str, start: int = 0, length: int | None = None) -> IO[bytes]:
        """A reader of ``length`` bytes (or to the end) of ``key`` from byte ``start`` (ranged GETs).

        The first range is fetched here, so a missing object fails now.

        Raises:
            ValueError: ``key`` is not a valid key, or ``start``/``length`` is negative.
            SnapshotNotFoundError: no object ``key``.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be >= 0")
        if length == 0:
            if self.head(key) is None:
                raise SnapshotNotFoundError("no such object", sandbox_path=None, context={"key": key})
            return io.BytesIO(b"")
        raw = _RangeReader(self, key, start, None if length is None else start + length)
        try:
            raw.begin()
        except BaseException:
            raw.close()
            raise
        return io.BufferedReader(raw, 1 << 20)

    def get_bytes(self, key: str, limit: int) -> bytes:
        """The whole of a small object (one ``GetObject``; an object over ``limit`` bytes is not read).

        A body the connection drops part way is read on from where it broke
        (see the module docstring).

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotNotFoundError: no object ``key``.
            SnapshotLimitError: it is longer than ``limit`` bytes.
            SnapshotStoreError: the store failed (also: the connection kept breaking, retryable).
        """
        validate_key(key)
        data, _etag, _size = self._get_span(key, 0, None, None, limit=limit)
        return bytes(data)

    def _get_span(self, key: str, pos: int, last: int | None, etag: str | None, *,
                  limit: int | None = None) -> tuple[bytearray, str | None, int | None]:
        """Bytes ``pos`` to ``last`` (inclusive; None: to the end) of one version of ``key``.

        ``etag`` (None: the current version) is sent as ``If-Match``.  A body
        the connection drops is asked for again from the byte it reached, with
        ``If-Match`` of the first answer's ETag, at most :data:`BODY_RESUMES`
        times; every answer must begin at the byte asked for.  A read of a
        whole object asks no range (S3 refuses ``bytes=0-`` of an empty one).

        Returns:
            ``(data, etag, object size)``; ``(empty, etag, None)`` when ``pos``
            is at or past the end of the object (``InvalidRange``).

        Raises:
            SnapshotNotFoundError: no object ``key``.
            SnapshotLimitError: the object is larger than ``limit`` bytes (nothing is read).
            SnapshotStoreError: the store failed; the object was replaced while
                it was read (an answer of another ETag or size, or a resumed
                read whose first answer had no ETag), or the connection broke more than
                :data:`BODY_RESUMES` times (both retryable); an answer does not
                start at the byte asked for (not retryable).
        """
        data = bytearray()
        got, end, size, drops = 0, -1, None, 0
        while True:
            resp = self._request_span(key, pos + got, last, etag, resumed=end >= 0)
            if resp is None:
                return bytearray(), etag, None
            first_size = size
            etag = self._answer_etag(resp, key, etag, resumed=end >= 0)
            length, size = self._answer_span(resp, key, pos + got, last)
            if first_size is not None and size != first_size:
                raise self._changed(resp, key, "size")
            if end < 0:  # the first answer: how much the read wants
                if limit is not None and size > limit:
                    with contextlib.suppress(Exception):
                        resp["Body"].close()
                    raise SnapshotLimitError("the object is larger than its limit", sandbox_path=None,
                                             context={"key": key, "limit": limit})
                end = pos + length
                data = bytearray(length)
            got = self._read_body(resp["Body"], memoryview(data), got, min(end, pos + got + length) - pos)
            if pos + got >= end:
                return data, etag, size
            drops += 1
            if drops > BODY_RESUMES:
                raise self._errors.store("reading the object failed: the connection broke", key,
                                         {"error": "connection dropped mid-body", "resumes": BODY_RESUMES}, True)
            time.sleep(min(0.1 * drops, 0.5))

    def _request_span(self, key: str, at: int, last: int | None, etag: str | None,
                      resumed: bool) -> dict[str, Any] | None:
        """The ``GetObject`` answer from byte ``at`` (None: ``InvalidRange`` on a first request)."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key)}
        if at or last is not None:
            args["Range"] = f"bytes={at}-{'' if last is None else last}"
        if etag is not None:
            args["IfMatch"] = f'"{etag}"'
        try:
            return dict(self._client.get_object(**args))
        except Exception as exc:
            from botocore.exceptions import ClientError

            if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "InvalidRange" \
                    and not resumed:
                return None
            err = self._errors.translate(exc, key, "reading the object")
            if isinstance(err, SnapshotConflictError) or (isinstance(err, SnapshotNotFoundError) and resumed):
                raise self._errors.store("the object changed while it was read", key,
                                         {"error": "PreconditionFailed"}, True) from None
            raise err from None

    def _answer_etag(self, resp: dict[str, Any], key: str, etag: str | None, resumed: bool) -> str | None:
        """The answer's version: ``etag`` when one was asked for (``If-Match``), else the answer's own ETag.

        A store that ignores ``If-Match`` (or drops the ETag) would let bytes of two
        versions be spliced into one read: an answer must carry the ETag asked for,
        and a resumed read needs one to ask for.

        Raises:
            SnapshotStoreError: it carries another ETag, or none where one is needed (retryable).
        """
        got = _strip(str(resp.get("ETag") or "")) or None
        if etag is None:
            if resumed:  # the first answer had no ETag: nothing ties the rest to its version
                raise self._changed(resp, key, "no ETag")
            return got
        if got != etag:
            raise self._changed(resp, key, "ETag")
        return etag

    def _changed(self, resp: dict[str, Any], key: str, what: str) -> SnapshotStoreError:
        """The retryable error of an answer of another version than the read's (its body closed)."""
        with contextlib.suppress(Exception):
            resp["Body"].close()
        return self._errors.store("the object changed while it was read", key, {"error": what}, True)

    def _answer_span(self, resp: dict[str, Any], key: str, at: int, last: int | None) -> tuple[int, int]:
        """``(bytes of the answer the read wants, object size)``; the answer must begin at byte ``at``.

        Raises:
            SnapshotStoreError: it begins elsewhere, or is the whole object where a range from
                past byte 0 was asked for (a store that ignores ``Range``); not retryable.
        """
        span = _content_range(resp)
        if span is not None and span[0] == at and span[1] >= at:
            stop = span[1] if last is None else min(span[1], last)
            return stop - at + 1, span[2]
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if span is None and at == 0 and status == 200:  # the whole object
            size = int(resp.get("ContentLength", 0))
            return (size if last is None else min(size, last + 1)), size
        with contextlib.suppress(Exception):
            resp["Body"].close()
        raise self._errors.store("reading the object failed: the store answered with other bytes than asked for",
                                 key, {"error": "Content-Range"}, False)

    @staticmethod
    def _read_body(body: Any, buf: memoryview, got: int, stop: int) -> int:
        """Read ``body`` into ``buf[got:stop]``; returns how far it got (less: the connection broke or ended)."""
        try:
            while got < stop:
                n = body.readinto(buf[got:min(stop, got + _READ_PIECE)])
                if not n:
                    break
                got += n
        except _body_errors():
            pass  # resumed from ``got`` by the caller
        finally:
            with contextlib.suppress(Exception):
                body.close()
        return got

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order (``ListObjectsV2``, paginated).

        Objects under the store's prefix whose keys are not valid keys are left out.

        Raises:
            SnapshotStoreError: the store failed (also while iterating).
        """
        if not isinstance(prefix, str) or len(prefix) > 1024:
            raise ValueError("prefix must be a string of at most 1024 characters")
        full = self._full(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        # S3 lists in UTF-8 binary key order; SeaweedFS walks its filer's directories instead (it lists
        # "a/1" before "a.b"), so the listing is sorted here: the keys only, a few dozen bytes each
        return iter(sorted(self._list(full), key=lambda info: info.key))

    def _list(self, full: str) -> Iterator[ObjectInfo]:
        mine = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    listed = str(obj["Key"])
                    # the server is trusted to list only what starts with the prefix asked for; a key
                    # that does not (a misbehaving or hostile store) is left out, never cut by length
                    if not listed.startswith(full):
                        continue
                    key = listed[len(mine):]
                    try:
                        validate_key(key)
                    except ValueError:
                        continue
                    yield ObjectInfo(key, int(obj["Size"]), _strip(str(obj["ETag"])), _mtime(obj.get("LastModified")))
        except SnapshotStoreError:
            raise
        except Exception as exc:
            raise self._errors.translate(exc, None, "listing the store") from None

    # -- upkeep

    def abort_stale_uploads(self, older_than: float) -> int:
        """Abort multipart uploads under the prefix initiated more than ``older_than`` seconds ago.

        The age is measured on the server's clock: ``Initiated`` against the
        ``Date`` of the listing's response (the local clock only when a
        response has no ``Date``), so a local clock ahead of the server's
        never aborts an upload still being written.

        Returns:
            How many were aborted.

        Raises:
            SnapshotStoreError: the store failed.
        """
        full = f"{self.prefix}/" if self.prefix else ""
        aborted = 0
        try:
            for page in self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                      Prefix=full):
                cutoff = _server_time(page) - older_than
                for up in page.get("Uploads", []):
                    if _mtime(up.get("Initiated")) >= cutoff:
                        continue
                    with contextlib.suppress(Exception):
                        self._client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"],
                                                            UploadId=up["UploadId"])
                        aborted += 1
        except Exception as exc:
            raise self._errors.translate(exc, None, "cleaning unfinished uploads") from None
        return aborted

    def close(self) -> None:
        """Close the client's connections.  Idempotent."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._client.close()

    def __enter__(self) -> S3Objects:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3SnapshotStore(GenerationStore):
    """Snapshots in an S3-compatible bucket: :class:`GenerationStore` over :class:`S3Objects`.

    Generations, the compare-and-swap pointer (``If-Match`` /
    ``If-None-Match`` on ``PutObject``, which SeaweedFS and S3 evaluate
    atomically: no lease object is needed), retention and gc are
    :class:`GenerationStore`'s; the bucket is trusted for availability only
    (what is read back is checked against the digests in the pointer, the
    metadata and the session's MAC-protected state) and for confidentiality.

    Args:
        bucket: the bucket name.
        prefix: key prefix under which the store keeps its objects (``""``: the bucket's top).
        keep: restore points kept per snapshot name (default 2).
        endpoint_url, region_name, profile_name, aws_access_key_id,
            aws_secret_access_key, aws_session_token: as :class:`S3Options`;
            None takes them from the standard AWS configuration chain.
        options: a whole :class:`S3Options` instead (the keyword arguments above must then be None).
        client: an already-made boto3 S3 client (see :class:`S3Objects`).
        check: make one request now (``HeadBucket``), so a bad endpoint,
            credential or bucket fails here rather than at the first stop.
        baseline_key: see :class:`GenerationStore` (None: the baselines a
            restore leaves are used by this store object only).

    Raises:
        ValueError: ``bucket``, ``prefix``, ``keep`` or ``baseline_key`` is not valid, or both ``options`` and
            its fields are given.
        SnapshotStoreError: boto3 is missing, or (with ``check``) the bucket
            cannot be reached (retryable), is missing or refuses the
            credentials (not retryable).
    """

    def __init__(self, bucket: str, prefix: str = "", *, keep: int = 2, endpoint_url: str | None = None,
                 region_name: str | None = None, profile_name: str | None = None,
                 aws_access_key_id: str | None = None, aws_secret_access_key: str | None = None,
                 aws_session_token: str | None = None, options: S3Options | None = None, client: Any = None,
                 check: bool = False, baseline_key: bytes | None = None) -> None:
        fields = (endpoint_url, region_name, profile_name, aws_access_key_id, aws_secret_access_key,
                  aws_session_token)
        if options is not None and any(v is not None for v in fields):
            raise ValueError("give either options or its fields, not both")
        if options is None:
            options = S3Options(endpoint_url=endpoint_url, region_name=region_name, profile_name=profile_name,
                                aws_access_key_id=aws_access_key_id, aws_secret_access_key=aws_secret_access_key,
                                aws_session_token=aws_session_token)
        objects = S3Objects(bucket, prefix, options=options, client=client)
        try:
            super().__init__(objects, keep=keep, baseline_key=baseline_key)
            if check:
                objects.check()
        except BaseException:
            objects.close()
            raise

    def __repr__(self) -> str:
        return f"<S3SnapshotStore {self.objects!r} keep={self.keep}>"
