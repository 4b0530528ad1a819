"""The core stays pure: stdlib + numpy only, and no clock."""

import ast
import subprocess
import sys
from pathlib import Path

import kairos_ray.core

CORE = Path(kairos_ray.core.__file__).parent
FORBIDDEN_MODULES = {"ray", "vllm", "torch", "sklearn", "asyncio", "time", "datetime", "pydantic", "yaml"}


def test_core_imports_nothing_forbidden():
    code = (
        "import sys, kairos_ray.core; "
        f"print(','.join(sorted(m for m in {sorted(FORBIDDEN_MODULES)!r} if m in sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    # numpy itself may pull in `time`/`datetime`; what matters is that no core module imports them (below)
    assert not (set(loaded.split(",")) - {"", "time", "datetime"}), loaded


def test_no_core_module_imports_a_forbidden_module():
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN_MODULES, f"{path.name} imports {name}"
