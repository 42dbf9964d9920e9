"""Build every tiny checkpoint a run serves before any instance starts.

Checkpoints used to be built when their cell ran, so an instance prestarted for a later cell
(``prestart``: a reference started while the previous cell measures) found no checkpoint
directory and died at once (``HFValidationError``), to be restarted when its cell came: 38
process starts for 31 instances in a fresh ``make sweep``. :func:`prebuild_checkpoints` runs
before the first cell: each tiny model is copied from its committed fixture
(:mod:`pdsweep.tiny.fixtures`), generated (2-20 s) or trained (minutes, with progress lines),
once, in cell order. A model that cannot be built is returned with its error; its cells fail
with it when they run and none of their instances is prestarted.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from pdsweep.core.errors import UserError
from pdsweep.plan.cell import Cell
from pdsweep.plan.instance import model_path
from pdsweep.sweepfile.sweep import LoadedSweep, ModelSpec
from pdsweep.tiny.checkpoints import checkpoint_dir


def checkpoint_path(model: ModelSpec, name: str) -> str:
    """:func:`pdsweep.plan.instance.model_path`, a tiny checkpoint built (copied from its fixture,
    generated or trained) when it is not in the cache yet. Raises ``UserError`` when it cannot be built."""
    return str(checkpoint_dir(name, model)) if model.tiny is not None else model_path(model, name)


def prebuild_checkpoints(ls: LoadedSweep, cells: Iterable[Cell]) -> tuple[dict[str, str], dict[str, str]]:
    """``({model: checkpoint path}, {model: error})`` for the tiny models of ``cells``, each built
    (or found in the cache) now; prints one line per model to stderr."""
    built, failed = {}, {}
    for name in dict.fromkeys(c.model for c in cells):
        model = ls.catalogue.models[name]
        if model.tiny is None:
            continue
        t = time.monotonic()
        try:
            built[name] = checkpoint_path(model, name)
        except UserError as e:
            failed[name] = str(e)
            print(f"checkpoint {name}: cannot be built: {e}", file=sys.stderr, flush=True)
            continue
        print(f"checkpoint {name}: {built[name]} ({time.monotonic() - t:.1f} s)", file=sys.stderr, flush=True)
    return built, failed
