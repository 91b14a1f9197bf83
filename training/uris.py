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
    """The file SQLite opens for a SQLAlchemy SQLite URL: the name SQLAlchemy hands SQLite (its own
    `create_connect_args`), a `file:` URI's path when handed in URI mode; None for any other database, and for
    in-memory SQLite."""
    from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(url)
        if u.get_backend_name() != "sqlite":
            return None
        (name,), opts = SQLiteDialect_pysqlite().create_connect_args(u)
    except (ArgumentError, ValueError, TypeError):
        return None
    if name in (None, "", ":memory:"):
        return None
    if not opts.get("uri") or not name.startswith("file:"):  # a name as it is (made absolute unless in URI mode)
        return _opened(name)
    parts = urllib.parse.urlsplit(name)
    if parts.netloc not in ("", "localhost"):
        return _opened(name)  # not a URI SQLite would parse: the literal name, as a file
    if "memory" in urllib.parse.parse_qs(parts.query).get("mode", []):
        return None
    return _opened(urllib.parse.unquote(parts.path))  # the kernel resolves it: links first, then '..'


def _opened(name: str) -> Path:
    """The file the kernel opens for `name` from this folder (no '~' expansion: SQLite does none)."""
    return Path(os.path.join(os.getcwd(), name)).resolve()


def plain_sqlite(uri: str) -> bool:
    """sqlite:///<path> with no query and no `file:` URI: the form every part of gpuflow reads alike."""
    return uri.startswith(SQLITE) and "?" not in uri and not uri[len(SQLITE):].startswith("file:")


def same_store(a: str, b: str) -> bool:
    """Whether two store URIs name the same store: the same file for SQLite (a hard link of it included),
    else the same URL."""
    if not a or not b:
        return False
    fa, fb = sqlite_file(a), sqlite_file(b)
    if fa is not None or fb is not None:
        return fa is not None and fb is not None and _same_file(fa, fb)
    return a.rstrip("/") == b.rstrip("/")


def _same_file(a: Path, b: Path) -> bool:
    """One file as the kernel sees it (device and inode) when both exist, else one path (a store to be created)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet (or cannot be looked at): its path is all there is
        return a == b


