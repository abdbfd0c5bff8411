"""Fuzz targets kept in the project: each is a hypothesis strategy of hostile inputs and a
check that passes when the project answers with its own error (or works), and raises
`Escape` when anything else comes out. The tests (`tests/test_*fuzz*.py`) run them bounded in CI;
`benchmarks/fuzz.py` runs them longer and counts inputs and escapes."""

import os

# Examples per hypothesis fuzz test in CI; `benchmarks/fuzz.py` runs each target longer.
FUZZ_EXAMPLES = int(os.environ.get("Q4K_FUZZ_EXAMPLES", "150"))
