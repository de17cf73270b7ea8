"""The installed native build against a portable build of the same C, bit for bit.

Why: ``csrc/`` computes with 16-lane fp32 vectors, and each ISA has its own code for some
of their operations: AVX-512 intrinsics, and on AVX2 machines the two 256-bit halves of
every vector (``csrc/lanes.h``: the reduction trees, max / min, bf16 / fp16 conversion,
sqrt, comparison masks, and the hot loops run a half at a time). Those paths exist only
for speed: each must compute exactly what the portable C computes (the same lanes, the
same reduction trees, operands in the same order, IEEE sqrt, no FMA), or results would
depend on the machine a check runs on and batch invariance would hold only per ISA. The
other native tests compare with torch within tolerances and cannot see a wrong operand
order or a lane off by one in a padding path; this one can.

How: ``setup.py`` builds the extension again from a copy of ``csrc/`` into a temp dir
with ``SDC_GUARD_NATIVE_CFLAGS="-O2 -march=x86-64"`` (no AVX: the generic vector code
only), then this file, run as a script in two subprocesses, checks the same randomized
requests with each build: every tensor of ``native_weight_side``'s ``WeightSide`` (and
its encoding buffer, which holds the max / min of B's runs), of ``native_check``'s
``AbftCheck`` (warm and cold), ``native_clear``'s worst ratio and the row statistics of A
(taken from ``explain_failures``), on fp32 / bf16 / fp16, odd M, K and N, row-major,
column-major and strided operands, batches, bias, alpha / beta, a checksum weight, NaN /
Inf / huge values, signed zeros and corrupted products, on one thread and split over
forced threads. Values must agree bit for bit; a NaN must meet a NaN (C leaves a NaN's
payload to the compiler when both operands of an add are NaN, so the portable build
itself does not fix it). ``SDC_GUARD_ISA_SEED`` and ``SDC_GUARD_ISA_CASES`` draw another
or a larger set.

The attention kernels (``csrc/attn*``) choose their ISA at run time, and
tests/test_native_attention.py compares every path this CPU runs with the plain C one in
one process. Here the worker adds their results (forward and backward screens, plain C
and the automatic choice) on fixed operands, so the plain C path is also compared as the
portable flags compile it (``fmaf`` from libm where the target has no FMA).

A build that fails to compile skips the test, unless ``CI`` is set: there it fails, as
a skipped comparison would let an ISA path drift unnoticed.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it: see CONTRIBUTING.md

ROOT = Path(__file__).resolve().parents[3]  # the repository (this file also runs as a script: its worker)
PORTABLE_FLAGS = "-O2 -march=x86-64" if platform.machine().lower() in ("x86_64", "amd64") else "-O2"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- the requests ----------------------------------------------------------------------

def _layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values (last two dims) row-major, column-major or strided (no stride 1)."""
    if kind == "col":
        return x.mT.contiguous().mT
    if kind == "strided":
        big = torch.zeros(*x.shape[:-2], x.shape[-2] * 2, x.shape[-1] * 3, dtype=x.dtype)
        view = big[..., ::2, ::3]
        view.copy_(x)
        return view
    return x.contiguous()


def _spoil(x: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    """x with a few special values at random places."""
    x = x.clone()
    flat = x.view(-1) if x.is_contiguous() else None
    if flat is None or kind == "none" or x.numel() == 0:
        return x
    idx = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=g)
    if kind == "nan":
        flat[idx] = float("nan")
    elif kind == "inf":
        flat[idx[: len(idx) // 2 + 1]] = float("inf")
        flat[idx[len(idx) // 2 + 1:]] = float("-inf")
    elif kind == "huge":
        flat[idx] = torch.finfo(x.dtype).max / 2
    elif kind == "corrupt":
        flat[idx] = flat[idx] * 1.5 + 3.0
    elif kind == "zeros":  # signed zeros everywhere: the max / min operand order shows
        x = torch.where(torch.rand(x.shape, generator=g) < 0.5, torch.zeros_like(x), -torch.zeros_like(x))
    return x


def cases(seed: int, count: int) -> list[dict]:
    """Randomized requests, plus fixed ones that cover each path at least once."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    specs = [  # (dtype, m, k, n, a, b, c layout, batch, bias, special[@operand], threads)
        (torch.float32, 300, 256, 768, "row", "row", "row", 0, None, "none", 1),
        (torch.bfloat16, 64, 300, 513, "col", "col", "row", 0, "vec", "none", 2),
        (torch.float16, 17, 100, 300, "strided", "strided", "col", 0, "full", "corrupt", 3),
        (torch.float32, 1, 1030, 1000, "row", "col", "row", 0, None, "nan@b", 1),
        (torch.bfloat16, 4, 64, 256, "row", "row", "row", 3, "vec", "inf@a", 2),
        (torch.float16, 300, 70, 17, "col", "row", "col", 2, "col1", "huge", 1),
        (torch.float32, 300, 1030, 1300, "col", "row", "row", 0, None, "none", 2),
        # signed zeros only, where max / min return an operand by its position: row
        # statistics of A (row-major, column-major fused and chunked), runs of B
        (torch.float32, 17, 300, 300, "row", "col", "row", 0, None, "zeros@a", 1),
        (torch.bfloat16, 40, 100, 1000, "col", "row", "row", 0, None, "zeros@a", 1),
        (torch.float32, 64, 100, 1300, "col", "row", "row", 0, "vec", "zeros@a", 1),
        (torch.float16, 3, 16, 1, "col", "strided", "row", 0, "scalar", "zeros@b", 1),
        (torch.float32, 5, 300, 600, "row", "row", "row", 0, None, "zeros@b", 2),
        (torch.bfloat16, 5, 1030, 300, "row", "col", "row", 0, None, "zeros@b", 1),
    ]
    for _ in range(count):
        specs.append((pick(DTYPES), pick([1, 3, 4, 17, 64, 300]), pick([1, 7, 16, 64, 100, 256, 300, 1030]),
                      pick([1, 17, 255, 256, 300, 513, 1000]), pick(["row", "col", "strided"]),
                      pick(["row", "col", "strided"]), pick(["row", "row", "col"]), pick([0, 0, 0, 2, 3]),
                      pick([None, None, "vec", "full", "col1", "scalar"]),
                      pick(["none"] * 6 + ["nan", "inf", "huge", "corrupt", "zeros"]), pick([1, 1, 2, 3])))
    out = []
    for dt, m, k, n, al, bl, cl, bt, bias_kind, special, threads in specs:
        lead = (bt,) if bt else ()
        # NaN / Inf / huge / zeros in A or B go into the product; in C, or a corrupted C,
        # they are the product's error
        special, _, where = special.partition("@")
        where = where or ("c" if special == "corrupt" else pick(["a", "b", "c"]))
        a = _spoil(torch.randn(*lead, m, k, generator=g).to(dt), special if where == "a" else "none", g)
        b = _spoil(torch.randn(*(lead if bt and m % 2 else ()), k, n, generator=g).to(dt),
                   special if where == "b" else "none", g)
        alpha, beta = pick([1.0, 0.5, -3.0]), pick([1.0, -2.0, 0.25])
        bias = None
        if bias_kind == "vec":
            bias = torch.randn(n, generator=g)
        elif bias_kind == "full":
            bias = torch.randn(*lead, m, n, generator=g)
        elif bias_kind == "col1":
            bias = torch.randn(m, 1, generator=g)
        elif bias_kind == "scalar":
            bias = torch.randn((), generator=g)
        prod = alpha * (a.float() @ b.float())
        if bias is not None:
            bias = bias.to(pick([dt, torch.float32]))
            prod = prod + beta * bias.float()
        c = _spoil(prod.to(dt), special if where == "c" else "none", g)
        r = torch.rand(n, generator=g) + 0.5 if pick([False, False, True]) else None
        out.append(dict(a=_layout(a, al), b=_layout(b, bl), c=_layout(c, cl), bias=bias, alpha=alpha,
                        beta=beta if bias is not None else 1.0, r=r, threads=threads))
    return out


# --- one build's results (run as a script, in a subprocess per build) -------------------

def results(case_file: str) -> list[dict]:
    import inspect

    from sdc_guard.backends import native
    from sdc_guard.backends import GemmRequest
    from sdc_guard.core.precision import DEFAULT_E_MAX

    # The row statistics of A (mean, max, min) leave the kernel only for a failed check,
    # as arguments of explain_failures: a check of C with an Inf in it hands them over.
    # Max / min operand order shows nowhere else (a signed zero or a NaN that the NaN
    # rescan overwrites).
    explain, rows = native.explain_failures, []

    def capture(*args, **kwargs):
        bound = inspect.signature(explain).bind(*args, **kwargs)
        rows.append([bound.arguments[name].clone() for name in ("mu", "hi", "lo")])
        return explain(*args, **kwargs)

    native.explain_failures = capture
    out = []
    for cs in torch.load(case_file, weights_only=False):
        threads, force = cs["threads"], cs["threads"] > 1
        a, b, c, r = cs["a"], cs["b"], cs["c"], cs["r"]
        got: dict = {}
        ws = native.native_weight_side(b, r, threads=threads, force_threads=force)
        for f in ("br", "babs", "p1", "p2", "v", "col_norm", "bad"):
            got[f"ws.{f}"] = getattr(ws, f)
        for i, f in enumerate(ws.factors):
            got[f"ws.factor{i}"] = f
        buf = getattr(ws, "_buf", None)  # a native encoding: the max / min of B's runs too
        if isinstance(buf, torch.Tensor):
            n4 = buf.numel() // 4 * 4
            got["ws.buffer"], got["ws.buffer_tail"] = buf[:n4].view(torch.float32), buf[n4:]
        base = dict(e_max=DEFAULT_E_MAX[a.dtype], checksum_weight=r, bias=cs["bias"], alpha=cs["alpha"],
                    beta=cs["beta"])
        for name, weight in (("warm", ws), ("cold", None)):
            chk = native.native_check(GemmRequest(a, b, c, weight=weight, **base), threads=threads,
                                      force_threads=force)
            assert chk is not None
            for f in ("ok", "inputs_bad", "possible_overflow", "diff", "threshold", "clear", "worst_ratio"):
                got[f"{name}.{f}"] = getattr(chk, f)
        got["clear"] = native.native_clear(GemmRequest(a, b, c, weight=ws, **base), native.Scratch())
        c_inf = c.contiguous().clone()
        c_inf.view(-1)[0] = float("inf")
        rows.clear()
        native.native_check(GemmRequest(a, b, c_inf, weight=ws, **base), threads=threads, force_threads=force)
        assert len(rows) == 1, "explain_failures was not called: the row statistics hook needs updating"
        got["rows.mu"], got["rows.hi"], got["rows.lo"] = rows[0]
        out.append({key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in got.items()})
    out.append(attention_results())
    return out


def attention_results() -> dict:
    """The native attention screens on fixed operands (fp32 / bf16 / fp16; causal, GQA,
    boolean and additive masks; odd L, S and head dims), plain C and the automatic ISA."""
    from sdc_guard.backends import native_attention as na
    from sdc_guard.core.attention import AttentionOperands

    g = torch.Generator().manual_seed(11)
    got: dict = {}
    specs = [(torch.float32, 4, 2, 70, 70, 24, True, None), (torch.bfloat16, 2, 1, 33, 50, 40, False, "bool"),
             (torch.float16, 3, 3, 300, 17, 8, False, "float")]
    for i, (dt, hq, hkv, l, s, d, causal, mask) in enumerate(specs):
        q = torch.randn(2, hq, l, d, generator=g).to(dt)
        k, v = (torch.randn(2, hkv, s, d, generator=g).to(dt) for _ in range(2))
        o, do, dq = (torch.randn(2, hq, l, d, generator=g).to(dt) for _ in range(3))
        dk, dv = (torch.randn(2, hkv, s, d, generator=g).to(dt) for _ in range(2))
        m = None
        if mask == "bool":
            m = torch.rand(l, s, generator=g) > 0.3
        elif mask == "float":
            m = torch.randn(2, 1, l, s, generator=g).to(dt)
        ops = AttentionOperands(q, k, v, m, causal, 0.37)
        for isa in ("generic", "auto"):
            fwd = na.native_forward_screen(ops, o, isa=isa, threads=2)
            bwd = na.native_backward_screen(ops, do, o, dq, dk, dv, isa=isa, threads=2)
            assert fwd is not None and bwd is not None
            for name, check in (("o", fwd), ("dq", bwd.dq), ("dk", bwd.dk), ("dv", bwd.dv)):
                for f in ("diff", "threshold", "ok", "inputs_bad"):
                    got[f"attn{i}.{isa}.{name}.{f}"] = getattr(check, f).clone()
    return got


def _main(argv: list[str]) -> None:
    """``worker SO_DIR|- CASES OUT``: results of the build in SO_DIR (``-``: the installed one)."""
    _, so_dir, case_file, out_file = argv
    torch.set_num_threads(4)
    if so_dir != "-":
        import importlib.util

        from sdc_guard.backends import native

        path = next(Path(so_dir).glob("sdc_guard/_vabft_cpu*"))
        spec = importlib.util.spec_from_file_location("sdc_guard._vabft_cpu", path)
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        native._import = lambda: (ext, None)
    torch.save(results(case_file), out_file)
    # one build mapped, the one asked for (with both, the comparison could be vacuous)
    maps = Path("/proc/self/maps")
    if maps.exists():
        mapped = {line.split()[-1] for line in maps.read_text().splitlines() if "_vabft_cpu" in line}
        assert len(mapped) == 1 and (so_dir == "-" or mapped == {str(path)}), mapped


# --- the test ---------------------------------------------------------------------------

def _bits(x: object) -> object:
    """What must agree: a tensor's raw bits with every NaN made one, a float's likewise."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            x = x.float()
            return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x).view(torch.int32)
        return x
    if isinstance(x, float):
        return "nan" if math.isnan(x) else struct.pack("<d", x)
    return x


def _build_portable(tmp: Path) -> tuple[Path | None, str]:
    """The portable build under tmp / "lib", or None and the build's log."""
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "csrc", src / "csrc")
    env = dict(os.environ, SDC_GUARD_NATIVE_CFLAGS=PORTABLE_FLAGS)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp / "lib"),
                           "--build-temp", str(tmp / "obj")], cwd=src, env=env, capture_output=True, text=True)
    # the extension is optional: setuptools reports a failed compile and goes on
    if proc.returncode != 0 or not list((tmp / "lib").glob("sdc_guard/_vabft_cpu*")):
        return None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tmp / "lib", ""


@pytest.mark.corpus  # rebuilds the extension for each ISA, about 50 s (CONTRIBUTING.md)
def test_isa_paths_match_portable_c(tmp_path: Path) -> None:
    from sdc_guard.backends import native

    if not native.available():
        if os.environ.get("CI"):
            pytest.fail(f"native extension unavailable in CI: {native.unavailable_reason()}")
        pytest.skip(str(native.unavailable_reason()))
    lib, log = _build_portable(tmp_path)
    if lib is None:
        if os.environ.get("CI"):
            pytest.fail(f"portable build of csrc/ failed:\n{log}")
        pytest.skip(f"portable build of csrc/ failed (no C compiler?): {log[-300:]}")
    case_file = tmp_path / "cases.pt"
    torch.save(cases(seed=int(os.environ.get("SDC_GUARD_ISA_SEED", "0")),
                     count=int(os.environ.get("SDC_GUARD_ISA_CASES", "24"))), case_file)
    procs = {name: subprocess.Popen([sys.executable, __file__, "worker", so, str(case_file),
                                     str(tmp_path / f"{name}.pt")], stderr=subprocess.PIPE, text=True)
             for name, so in (("installed", "-"), ("portable", str(lib)))}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} worker failed:\n{err[-4000:]}"
    got = torch.load(tmp_path / "installed.pt", weights_only=False)
    want = torch.load(tmp_path / "portable.pt", weights_only=False)
    specs = torch.load(case_file, weights_only=False)
    assert len(got) == len(want) == len(specs) + 1  # the GEMM cases, then the attention screens
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for key in g:
            gb, wb = _bits(g[key]), _bits(w[key])
            same = torch.equal(gb, wb) if isinstance(gb, torch.Tensor) else gb == wb
            if not same and i == len(specs):
                raise AssertionError(f"attention screen: {key} differs between the installed and the portable build")
            if not same:
                cs = specs[i]
                desc = {k: (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v
                        for k, v in cs.items()}
                raise AssertionError(f"case {i} {desc}: {key} differs between the installed and the portable "
                                     f"build\ninstalled: {g[key]}\nportable:  {w[key]}")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    _main(sys.argv[1:])
