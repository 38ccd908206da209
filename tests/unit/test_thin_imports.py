"""The processes that never run an engine stay thin: importing the Ray Serve app (every
front-end replica imports it) or the scheduler actor loads neither torch nor the
engine. The worker actor's class is looked up only when a worker starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

THIN = ("tessera.cluster.serve_app", "tessera.scheduler.actor")


def _heavy(name: str) -> bool:
    return name == "torch" or name.startswith(("torch.", "tessera.workers.engine"))


@pytest.mark.parametrize("module", THIN)
def test_importing_loads_neither_torch_nor_the_engine(module: str):
    code = f"import json, sys\nimport {module}\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = json.loads(done.stdout.splitlines()[-1])
    heavy = [name for name in loaded if _heavy(name)]
    assert not heavy, f"importing {module} loaded {heavy}"
