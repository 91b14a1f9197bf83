"""Store URIs, the one place that reads them: the file SQLite opens, whether two URIs name one store, a relative
sqlite:/// made absolute, a URL without its password. Torch-free and Prefect-free."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

SQLITE = "sqlite:///"


def absolute_uri(uri: str) -> str:
    """sqlite:///relative.db as an absolute path: the same store from any working folder."""
    rest = uri[len(SQLITE):]
    if uri.startswith(SQLITE) and not rest.startswith("/") and rest != ":memory:":
        return SQLITE + str(Path(rest).resolve())
    return uri


def shown(uri: str) -> str:
    """A URI as logs, tags and errors may show it: without its password."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()


def sqlite_file(url: str) -> Path | None:
    """The file SQLite opens for a SQLAlchemy SQLite URL (a `file:` URI's path with `?uri=true`); None for any
    other database, and for in-memory SQLite."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(url)
    except (ArgumentError, ValueError):
        return None
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    database = u.database
    if str(u.query.get("uri", "")).lower() in ("true", "1") or database.startswith("file:"):
        parts = urllib.parse.urlsplit(database)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
            return _opened(database)  # not a URI SQLite would parse: the literal name, as a file
        if "memory" in (u.query.get("mode"), *urllib.parse.parse_qs(parts.query).get("mode", [])):
            return None
        return _opened(urllib.parse.unquote(parts.path))  # the kernel resolves it: links first, then '..'
    return _opened(os.path.abspath(database))  # SQLAlchemy hands SQLite abspath(name): '..' collapsed first


def _opened(name: str) -> Path:
    """The file the kernel opens for `name` from this folder (no '~' expansion: SQLite does none)."""
    return Path(os.path.join(os.getcwd(), name)).resolve()


def plain_sqlite(uri: str) -> bool:
    """sqlite:///<path> with no query and no `file:` URI: the form every part of gpuflow reads alike."""
    return uri.startswith(SQLITE) and "?" not in uri and not uri[len(SQLITE):].startswith("file:")


def same_store(a: str, b: str) -> bool:
    """Whether two store URIs name the same store: the same file for SQLite, else the same URL."""
    if not a or not b:
        return False
    fa, fb = sqlite_file(a), sqlite_file(b)
    if fa is not None or fb is not None:
        return fa == fb
    return a.rstrip("/") == b.rstrip("/")


