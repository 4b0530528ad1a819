"""Keeps scikit-learn out of the replicas that import vLLM.

vLLM's config imports transformers' auto classes, and with them transformers' assisted-generation
module, which imports ``sklearn.metrics`` whenever scikit-learn is installed; it is, for the
step-latency fitter (``serve.refit``). The ingress and the engines never run transformers'
generation. ``hide_sklearn_from_transformers`` (called by ``kairos_ray.serve``, the first of the
package a replica imports, whatever Serve unpickles first) has transformers' availability check
answer no just before that module loads: the import is skipped, and scikit-learn stays importable
for whatever else the process runs. A process that never imports transformers pays nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

GENERATION = "transformers.generation.candidate_generator"


def _unavailable() -> bool:
    """transformers' ``is_sklearn_available`` in this process: assisted generation runs without it."""
    return False


class _SklearnHidden(importlib.abc.MetaPathFinder):
    """Finds nothing; on the way to ``GENERATION`` it has ``is_sklearn_available`` answer no, then leaves."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == GENERATION:
            sys.meta_path.remove(self)
            for name in ("transformers.utils", "transformers.utils.import_utils"):  # the name it imports, its source
                vars(importlib.import_module(name))["is_sklearn_available"] = _unavailable
        return None


def hide_sklearn_from_transformers() -> None:
    """Before transformers' generation modules load in this process (a no-op after they did)."""
    if GENERATION not in sys.modules:
        sys.meta_path.insert(0, _SklearnHidden())
