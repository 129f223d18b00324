"""What the benchmark scripts read back from a `meshpipe train` run: the tokens/s its final
line reports (steady steps, the warm-up step left out)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

__all__ = ["tokens_per_s"]

_TOKENS = re.compile(r"\(([\d,.]+) tokens/s")


def tokens_per_s(command: Sequence[str]) -> float:
    """Run `command` (a `meshpipe train`, failing loudly) and return the tokens/s it reports."""
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found = _TOKENS.search(out)
    if found is None:
        raise RuntimeError(f"no tokens/s in the run's output:\n{out}")
    return float(found.group(1).replace(",", ""))
