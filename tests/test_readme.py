"""The README's Python blocks run as written, each in a fresh process from a scratch folder (what a
new user pasting them would do)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs_as_written(index, tmp_path):
    script = tmp_path / f"readme_{index}.py"
    script.write_text(BLOCKS[index])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"README block {index + 1}:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
