"""docs/INTEGRATION.md's GPU examples run as written: each python block that starts with "# GPU example",
with ``rt`` the process's chunkring runtime (under mpirun, every rank runs it)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "INTEGRATION.md"


def test_the_integration_guide_examples_run(runtime):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
              if b.startswith("# GPU example")]
    assert blocks, "docs/INTEGRATION.md has no GPU example"
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), {"rt": runtime})
