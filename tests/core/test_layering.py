"""The layers point one way: the live path never imports the simulator, and the core imports nothing of the project.

A check anyone can repeat with grep:
    grep -rnE '(from|import) kairos_ray\\.sim' kairos_ray/serve kairos_ray/engines kairos_ray/kv   # nothing
    grep -rn 'kairos_ray\\.' kairos_ray/core | grep -v 'kairos_ray\\.core'                       # nothing
"""

import re
from pathlib import Path

import kairos_ray

PACKAGE = Path(kairos_ray.__file__).parent
IMPORT = re.compile(r"^\s*(?:from|import)\s+(kairos_ray(?:\.\w+)*)", re.MULTILINE)


def imports_of(folder: str) -> dict[str, set[str]]:
    """Project modules each file under ``folder`` imports (top-level and deferred imports alike)."""
    return {
        str(path.relative_to(PACKAGE)): set(IMPORT.findall(path.read_text()))
        for path in sorted((PACKAGE / folder).rglob("*.py"))
    }


def test_the_live_path_never_imports_the_simulator():
    for folder in ("serve", "engines", "kv"):
        for path, modules in imports_of(folder).items():
            assert not any(m == "kairos_ray.sim" or m.startswith("kairos_ray.sim.") for m in modules), path


def test_the_core_imports_nothing_of_the_project_outside_itself():
    files = imports_of("core")
    assert files, "no core modules found"
    for path, modules in files.items():
        assert all(m.startswith("kairos_ray.core") for m in modules), (path, modules)


def test_the_check_sees_deferred_imports():
    """A guard on the check itself: an import inside a function counts."""
    assert IMPORT.findall("def f():\n    from kairos_ray.sim.run import SimSetup\n") == ["kairos_ray.sim.run"]
