"""Build of the optional native CPU backend (``sdc_guard._vabft_cpu``, the C files of ``csrc/``).

Everything else about the package is in ``pyproject.toml``. The extension is plain C (it
needs neither torch nor numpy to build, so pip's isolated build environment stays small)
and ``optional``: without a C compiler the install still succeeds and ``sdc_guard`` uses
its portable torch path (``sdc_guard.backends.native.unavailable_reason()`` says why).

It is compiled with ``-march=native``: built on the machine that runs it, as an editable
or source install is. For a wheel meant for other machines set
``SDC_GUARD_NATIVE_CFLAGS`` (say ``-O3 -march=x86-64-v3``). The flags never include
``-ffast-math``: NaN / Inf must keep IEEE semantics for the non-finite classification,
and ``-ffp-contract=off`` keeps every row's arithmetic identical across code paths
(batch invariance).
"""

import os
import shlex

from setuptools import Extension, setup

_DEFAULT_FLAGS = "-O3 -march=native"
_FIXED_FLAGS = ["-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-pthread"]
# one file per concept (csrc/vabft_cpu.h says what each holds); the headers are depends so
# that editing one rebuilds the extension and an sdist ships them
_SOURCES = [f"csrc/{name}.c" for name in ("module", "parallel", "weight_side", "check", "check_a", "check_sums", "coll_sums",
                                           "attn", "attn_isa_generic", "attn_isa_avx2", "attn_isa_avx512")]
_HEADERS = [f"csrc/{name}.h" for name in ("vabft_cpu", "lanes", "runs", "check", "attn", "attn_simd",
                                           "attn_body")]

setup(
    ext_modules=[
        Extension(
            "sdc_guard._vabft_cpu",
            sources=_SOURCES,
            depends=_HEADERS,
            extra_compile_args=shlex.split(os.environ.get("SDC_GUARD_NATIVE_CFLAGS", _DEFAULT_FLAGS)) + _FIXED_FLAGS,
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
