"""Fixtures shared by several test modules. Module-scoped, as they were in each module:
every module gets its own copy, so a test that edits one cannot leak into another file."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fakes import build_tokenizer
from fixtures.make_runs import write_all


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The committed fixture runs (:func:`fixtures.make_runs.write_all`): run name -> run
    directory (``all-pass``, ``mixed``, ``fixed``, ``unfixed``, ``mission``)."""
    return write_all(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a small byte-level BPE tokenizer (:func:`_fakes.build_tokenizer`)."""
    return build_tokenizer(tmp_path_factory.mktemp("tok"))
