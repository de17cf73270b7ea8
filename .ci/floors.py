"""Print the lowest versions pyproject.toml declares, pinned, one a line (for .ci/run).

The runtime dependencies and the integrations' extras (lightning, transformers); torch is
left out: CI keeps the CPU build on disk (torch==2.13.0), never another.
"""

import re
import sys
import tomllib
from pathlib import Path

EXTRAS = ("lightning", "transformers")
SKIP = {"torch"}

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
requirements = project["dependencies"] + [r for extra in EXTRAS for r in project["optional-dependencies"][extra]]
for requirement in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][A-Za-z0-9.]*)(?:\s*,\s*<\s*[0-9][A-Za-z0-9.]*)?", requirement.strip())
    if match is None:
        sys.exit(f".ci/floors.py: cannot read a floor from {requirement!r} (expected 'name>=version' or 'name>=version,<ceiling')")
    if match.group(1).lower() not in SKIP:
        print(f"{match.group(1)}=={match.group(2)}")
