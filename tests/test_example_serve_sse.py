"""examples/serve_sse.py without the `serve` extra says what to install, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_cli_logs import CALL_TIMEOUT_S

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "serve_sse.py"


def test_without_the_serve_extra_it_says_what_to_install(tmp_path: Path) -> None:
    # A `uvicorn` module ahead of the installed one that is not there, as without the extra.
    (tmp_path / "uvicorn.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n")
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True,
        timeout=CALL_TIMEOUT_S, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "uvicorn is missing" in line and "pip install 'q4k-actors[serve]'" in line
