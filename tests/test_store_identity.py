"""Two store URIs name one store when SQLite would open one file, as the kernel sees it (device and inode): a hard
link of the tracking store is that store, at the served door (training/policy.py) and in a local sweep
(training/uris.py `same_store`)."""

from __future__ import annotations

import os
import sqlite3

import pytest

from gpuflow.training.errors import UserError
from gpuflow.training.policy import NotAllowed, Policy, check_not_tracking_store
from gpuflow.training.uris import same_store

pytestmark = pytest.mark.fast


def _store(path) -> str:
    """A real SQLite file at `path` (a table in it), as its sqlite:/// URI."""
    with sqlite3.connect(path) as db:
        db.execute("create table if not exists t (x)")
    return f"sqlite:///{path}"


@pytest.fixture
def served(tmp_path):
    """serve's folder tmp_path/serve holding its tracking store mlflow.db; one further store allowed by name."""
    home = tmp_path / "serve"
    home.mkdir()
    (tmp_path / "named").mkdir()
    tracking = _store(home / "mlflow.db")
    allowed = _store(tmp_path / "named" / "allowed.db")
    return Policy(frozenset(), (home,), tracking, (allowed,))


def test_a_hard_link_of_the_tracking_store_is_refused_as_a_study_storage(served, tmp_path):
    link = tmp_path / "serve" / "study.db"
    os.link(tmp_path / "serve" / "mlflow.db", link)  # inside the allowed folder: only its identity refuses it
    for storage in (served.home_store, f"sqlite:///{link}"):
        with pytest.raises(UserError, match="is the tracking store's own file"):
            served.check_storage(storage, served.home_store)
        with pytest.raises(UserError, match="is the tracking store's own file"):
            check_not_tracking_store(storage, served.home_store)


def test_a_hard_link_of_an_allowed_store_is_that_store(served, tmp_path):
    link = tmp_path / "elsewhere.db"  # outside the allowed folders: accepted only as the store it is
    os.link(tmp_path / "named" / "allowed.db", link)
    served.check_store("tracking_uri", f"sqlite:///{link}")
    served.check_storage(f"sqlite:///{link}", served.home_store)
    assert same_store(f"sqlite:///{link}", served.stores[0])


def test_two_different_files_are_two_stores(served, tmp_path):
    copy = tmp_path / "serve" / "copy.db"
    copy.write_bytes((tmp_path / "serve" / "mlflow.db").read_bytes())  # the same bytes, another file
    assert not same_store(f"sqlite:///{copy}", served.home_store)
    served.check_storage(f"sqlite:///{copy}", served.home_store)
    check_not_tracking_store(f"sqlite:///{copy}", served.home_store)
    with pytest.raises(NotAllowed, match="records to the operator's tracking store"):
        served.check_store("tracking_uri", f"sqlite:///{tmp_path / 'other.db'}")


def test_a_store_not_created_yet_is_judged_by_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    new = tmp_path / "new.db"
    assert same_store(f"sqlite:///{new}", "sqlite:///new.db")  # neither exists: one path
    assert not same_store(f"sqlite:///{new}", _store(tmp_path / "old.db"))
    assert not same_store(f"sqlite:///{new}", "postgresql://h/new.db")
