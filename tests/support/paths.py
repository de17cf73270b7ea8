"""Where the repository's pieces are, for a test in any folder under ``tests/``.

``tests/conftest.py`` puts this folder (``tests/support``) on ``sys.path``: the helpers
and the worker scripts started as subprocesses are imported by name from every folder.
"""

from pathlib import Path

#: tests/support: the shared helpers, the worker scripts, the nvidia_resiliency_ext stand-in
SUPPORT = Path(__file__).resolve().parent
#: the repository's root (examples/, csrc/, sdc_guard/)
ROOT = SUPPORT.parent.parent
