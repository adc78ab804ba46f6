"""Storage options from the standard environment, and storage errors a user can act on.

Every place that opens a root through fsspec (the rollout store, checkpoints, trainer states,
metrics files) goes through `open_fs` / `storage_options_for`, so `s3://` roots honour the
standard AWS configuration the same way everywhere:

- credentials: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (+ `AWS_SESSION_TOKEN`), `AWS_PROFILE`,
  `~/.aws/credentials`, instance roles - resolved by botocore itself, never by rollflow;
- endpoint: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (MinIO, Ceph, moto, ...). botocore >= 1.31
  reads them too, but we pass the endpoint explicitly: older botocore ignores the variables, and
  fsspec caches filesystem instances by their arguments, so an endpoint that only lives in the
  environment would let a cached client keep talking to the previous endpoint.

Never put `region_name` into s3fs `client_kwargs` (mkdir then fails with a location-constraint
error on non-AWS endpoints); botocore resolves the region from `AWS_REGION` / the profile.

Credentials never travel through rollflow objects: not through RunConfig (so never through
Prefect parameters), not through actor arguments, not into messages. `redact` scrubs their
values from any text we build from a third-party error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fsspec.core import url_to_fs

from .errors import (
    ArtifactError,
    StorageAuthError,
    StorageBucketNotFound,
    StorageError,
    StorageUnavailable,
)

S3_PROTOCOLS = frozenset({"s3", "s3a"})
SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")
SECRET_OPTION_KEYS = (
    "key",
    "secret",
    "token",
    "password",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
)

# Exception class names (botocore, aiohttp, urllib3) that mean "the endpoint did not answer".
_UNREACHABLE_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
        "HTTPClientError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ClientOSError",
        "ServerTimeoutError",
        "NewConnectionError",
        "FSTimeoutError",
        "IncompleteRead",
        "ClientPayloadError",
    }
)
_NO_CREDENTIALS_NAMES = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "ProfileNotFound",
        "SSOTokenLoadError",
        "UnauthorizedSSOTokenError",
    }
)
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "AllAccessDisabled",
        "AccountProblem",
        "403",
    }
)
_SERVER_BUSY_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "500",
        "502",
        "503",
        "504",
    }
)


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_s3(url: str) -> bool:
    return protocol_of(url) in S3_PROTOCOLS


def endpoint_from_env() -> str | None:
    """The S3 endpoint the standard AWS variables select (None = AWS's own endpoints)."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true":
        return None
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def endpoint_for_display(endpoint: str | None) -> str | None:
    """An endpoint URL fit for messages and files: its user:secret@ part replaced by ***."""
    return None if endpoint is None else redact_url(endpoint)


def storage_options_for(url: str, explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsspec storage options for `url` from the environment, merged under `explicit` ones.

    For `s3://` that is the endpoint (as `client_kwargs.endpoint_url`); credentials are left to
    botocore's own chain (env, profile, instance role) so they never pass through our objects.
    Other protocols get `explicit` unchanged.
    """
    options: dict[str, Any] = {}
    if is_s3(url):
        endpoint = endpoint_from_env()
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    for key, value in (explicit or {}).items():
        if key == "client_kwargs" and isinstance(value, dict):
            options["client_kwargs"] = {**options.get("client_kwargs", {}), **value}
        else:
            options[key] = value
    return options


def open_fs(url: str, storage_options: dict[str, Any] | None = None):
    """`fsspec.core.url_to_fs` with `storage_options_for(url)`: (filesystem, path)."""
    return url_to_fs(url, **storage_options_for(url, storage_options))


def endpoint_of(fs: Any, url: str) -> str:
    """Human-readable endpoint a filesystem talks to (for messages; holds no credentials)."""
    if not is_s3(url):
        return protocol_of(url) + "://"
    client_kwargs = getattr(fs, "client_kwargs", None) or {}
    endpoint = client_kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None) or endpoint_from_env()
    return redact_url(str(endpoint)) if endpoint else "AWS S3 (default endpoint of the configured region)"


def bucket_of(url: str) -> str | None:
    if not is_s3(url):
        return None
    rest = url.split("://", 1)[1]
    return rest.split("/", 1)[0] or None


def _secret_values(extra: dict[str, Any] | None = None) -> list[str]:
    values = [os.environ.get(name, "") for name in SECRET_ENV_VARS]
    for key, value in (extra or {}).items():
        if key in SECRET_OPTION_KEYS and isinstance(value, str):
            values.append(value)
    # Very short values would blank out ordinary words; real keys are 16+ characters.
    return sorted({v for v in values if len(v) >= 8}, key=len, reverse=True)


# scheme://user[:secret]@host: the userinfo part of any URL in a text.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]+)@")
# ?key=...&secret=...: credential-looking query parameters.
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&](?:[A-Za-z0-9_.-]*(?:key|secret|token|password|signature|credential)[A-Za-z0-9_.-]*)=)"
    r"(?P<value>[^&\s'\"]+)",
    re.I,
)


def redact_url(url: str) -> str:
    """`url` (or any text holding URLs) with `user:secret@` and secret query values replaced by ***."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}***@", str(url))
    return _SECRET_QUERY.sub(lambda m: f"{m.group('key')}***", text)


def redact(text: str, storage_options: dict[str, Any] | None = None) -> str:
    """`text` with every credential value we know of (env, explicit options, the user:secret@ part and
    secret query values of URLs, AWS_ENDPOINT_URL's included) replaced by ***."""
    text = str(text)
    for value in _secret_values(storage_options):
        text = text.replace(value, "***")
    return redact_url(text)


# ----------------------------------------------------------------------------- error classification


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """exc, then what it wraps (Ray's `.cause`, `__cause__`, `__context__`), without loops."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        item = todo.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        for nxt in (getattr(item, "cause", None), item.__cause__, item.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = error.get("Code")
        if code:
            return str(code)
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return None


def error_codes(exc: BaseException) -> set[str]:
    return {code for item in _causes(exc) if (code := _error_code(item))}


def _names(exc: BaseException) -> set[str]:
    return {type(item).__name__ for item in _causes(exc)} | {
        base.__name__ for item in _causes(exc) for base in type(item).__mro__
    }


def is_transient(exc: BaseException) -> bool:
    """True for failures a retry may cure: the endpoint unreachable, timing out or busy."""
    for item in _causes(exc):
        if isinstance(item, StorageError):
            return item.transient
        if isinstance(item, ArtifactError):
            return False
    names = _names(exc)
    if names & _UNREACHABLE_NAMES:
        return True
    if error_codes(exc) & _SERVER_BUSY_CODES:
        return True
    return any(isinstance(item, (ConnectionError, TimeoutError)) for item in _causes(exc))


def is_permanent(exc: BaseException) -> bool:
    """True for failures a retry cannot cure: the data contract, a conflict, credentials, a missing bucket."""
    for item in _causes(exc):
        if isinstance(item, ArtifactError):
            return not (isinstance(item, StorageError) and item.transient)
    return False


def _short(exc: BaseException, storage_options: dict[str, Any] | None) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = redact(text, storage_options)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(
    exc: BaseException, *, uri: str, action: str, fs: Any = None, storage_options: dict[str, Any] | None = None
) -> StorageError | None:
    """A StorageError with an actionable message for `exc`, or None if it is not a storage failure.

    `action` reads like "writing" / "reading" / "listing"; `uri` names the object.
    """
    if isinstance(exc, ArtifactError):
        return None
    endpoint = endpoint_of(fs, uri)
    bucket = bucket_of(uri)
    where = f"bucket {bucket!r} at {endpoint}" if bucket else endpoint
    names = _names(exc)
    codes = error_codes(exc)
    detail = _short(exc, storage_options)
    if names & _NO_CREDENTIALS_NAMES:
        return StorageAuthError(
            f"no usable credentials for {where} while {action} {uri} ({detail}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (a profile in ~/.aws/credentials), in the environment of "
            "every process that reads or writes the store",
            uri=uri,
            endpoint=endpoint,
            bucket=bucket,
        )
    if codes & _AUTH_CODES or (is_s3(uri) and any(isinstance(i, PermissionError) for i in _causes(exc))):
        return StorageAuthError(
            f"{where} refused the request while {action} {uri} ({detail}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and that these credentials may read and write this bucket",
            uri=uri,
            endpoint=endpoint,
            bucket=bucket,
        )
    if "NoSuchBucket" in codes or (is_s3(uri) and "bucket does not exist" in str(exc).lower()):
        return StorageBucketNotFound(
            f"bucket {bucket!r} does not exist at {endpoint} ({action} {uri}); create it (e.g. "
            f"`aws s3 mb s3://{bucket}`) or fix store.root / AWS_ENDPOINT_URL",
            uri=uri,
            endpoint=endpoint,
            bucket=bucket,
        )
    if is_transient(exc):
        return StorageUnavailable(
            f"cannot reach {where} while {action} {uri} ({detail}); check connectivity to the endpoint "
            "(is it up? is AWS_ENDPOINT_URL right? proxy, DNS, firewall). Nothing half-written is "
            "visible: an artifact exists only once its manifest is committed, so running again is safe",
            uri=uri,
            endpoint=endpoint,
            bucket=bucket,
        )
    return None


@contextmanager
def storage_errors(
    uri: str, action: str, *, fs: Any = None, storage_options: dict[str, Any] | None = None
) -> Iterator[None]:
    """Re-raise storage failures inside the block as StorageError subclasses with clear messages.

    Everything else (and every ArtifactError) passes through unchanged; plain "file not found"
    on a local root stays a FileNotFoundError.
    """
    try:
        yield
    except ArtifactError:
        raise
    except Exception as exc:
        mapped = classify(exc, uri=uri, action=action, fs=fs, storage_options=storage_options)
        if mapped is None:
            raise
        # `from None`: the original exception's text is already in the message (redacted), and
        # third-party exceptions may carry request details we do not want in logs.
        raise mapped from None
