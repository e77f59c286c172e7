"""The config's field types, shared by every section: strict names, keys, seconds, URLs and listen addresses."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, ConfigDict, Field

from proxy.errors import redact_url

DEFAULT_LISTEN = "127.0.0.1:8080"

#: unknown keys are refused; types are strict when a file is read (``CONFIG_ADAPTER.validate_json(strict=True)``),
#: lax for Python callers (tests build these with tuples or lists alike)
SECTION = ConfigDict(extra="forbid")


def check_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        # the URL may hold a password (engines[].url, tracing.endpoint): never in an error message
        raise ValueError(f"expected a URL like http://host:port, got {redact_url(value)!r}")
    return value.rstrip("/")


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("expected a non-blank key (a blank key is no way to turn authentication off)")
    return value


def split_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; an empty host is 127.0.0.1) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. {DEFAULT_LISTEN}), got {value!r}")
    return (host or "127.0.0.1").strip("[]"), int(port)


def _listen(value: str) -> str:
    split_listen(value)
    return value


Url = Annotated[str, AfterValidator(check_url)]
Listen = Annotated[str, AfterValidator(_listen)]
HeaderName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"), AfterValidator(str.lower)]
Name = Annotated[str, Field(min_length=1)]
Key = Annotated[str, Field(min_length=1), AfterValidator(_non_blank)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
