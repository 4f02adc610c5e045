"""An S3 endpoint from the AWS configuration is never repeated in an error (it may hold credentials).

19c07b1 checks ``--store-endpoint`` up front without repeating it, but an
endpoint botocore reads itself (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
a config file) that it refuses raised botocore's ``ValueError("Invalid
endpoint: USER:PASS@...")``, which the CLI printed as ``cli_input: the s3://
store is not valid: Invalid endpoint: ...``.  No server is needed: the
client is made without a request.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("boto3", reason="the S3 store needs boto3 (sandbox-fs[s3])")

from sandbox_fs.snapshot import S3Objects, S3Options, SnapshotStoreError  # noqa: E402

SECRET = "Zq9SECRETpw"


def _env(endpoint: str, tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="examplekey",
               AWS_ENDPOINT_URL_S3=endpoint, AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    return env


def test_cli_does_not_print_a_refused_endpoint_from_the_environment(tmp_path):
    """The one stderr line names no part of the endpoint (the secret is the outside sentinel)."""
    proc = subprocess.run([sys.executable, "-m", "sandbox_fs", "snapshot", "ls", "--store", "s3://bucket1/p"],
                          env=_env(f"user:{SECRET}", tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.startswith("sandbox-fs: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert SECRET not in proc.stderr and SECRET not in proc.stdout
    assert "Traceback" not in proc.stderr


@settings(max_examples=10, deadline=None)
@given(scheme=st.sampled_from(["", "http://", "https://", "ftp://", "file://", "http:/", "://"]),
       user=st.sampled_from(["", "u:", "user:"]),
       host=st.sampled_from(["", "@", "@h", "@[::1", "@h:99999", "@h:x", " @h", "@h/p q"]))
def test_a_refused_endpoint_never_reaches_an_error_text(scheme, user, host):
    """Whatever the configured endpoint, making the client raises nothing that repeats it."""
    endpoint = f"{scheme}{user}{SECRET}{host}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        mp.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "examplekey")
        try:
            S3Objects("bucket1", "p").close()
        except SnapshotStoreError as exc:
            assert SECRET not in str(exc) and SECRET not in repr(exc.context)
            assert exc.code == "snapshot_store_unavailable" and not exc.retryable
        except Exception as exc:  # anything else is a leak of botocore's own text, or worse
            assert SECRET not in str(exc), type(exc).__name__
            raise


@pytest.mark.parametrize("env, hint", [
    ({"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": ""}, "no usable credentials"),
    ({"AWS_PROFILE": "no-such-profile"}, "profile or configuration file"),
])
def test_a_credential_or_profile_failure_is_not_blamed_on_the_endpoint(env, hint, tmp_path):
    """Making the client fails on the credentials or the profile: the reason says so, not 'is the endpoint ...'."""
    with pytest.MonkeyPatch.context() as mp:
        for k in list(os.environ):
            if k.startswith("AWS_"):
                mp.delenv(k)
        mp.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(SnapshotStoreError) as raised:
            S3Objects("bucket1", "p", options=S3Options(endpoint_url="http://127.0.0.1:1")).close()
    assert hint in str(raised.value) and "endpoint" not in str(raised.value)
