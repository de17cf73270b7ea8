/*
 * module.c: the CPython bindings of the native backend, the module sdc_guard._vabft_cpu.
 *
 * Only argument marshalling: sdc_guard/native_call.py passes shapes, strides and raw data
 * pointers as ints (it owns every buffer and its layout, so no buffer protocol or torch
 * is needed at build time), this file fills the kernels' contexts and calls them with the
 * GIL released. METH_FASTCALL keeps a call at a few ns per argument; py_noop, an entry
 * point that does nothing, isolates the binding's own share when profiling a call.
 * Nothing else of the backend includes Python.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "attn.h"
#include "vabft_cpu.h"

#define I(i) PyLong_AsLongLong(args[i])
#define P(i) ((char *)(intptr_t)PyLong_AsLongLong(args[i]))
#define F(i) ((float)PyFloat_AsDouble(args[i]))
#define D(i) PyFloat_AsDouble(args[i])

/* weight_side(b, dt, bt, k, n, sbb, sbk, sbn, r, br, babs, hi, lo, agg, bad, threads) -> None */
static PyObject *py_weight_side(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "weight_side: expected 16 arguments");
        return NULL;
    }
    ws_ctx c;
    c.b = P(0);
    c.dt = (int)I(1);
    c.bt = I(2);
    c.k = I(3);
    c.n = I(4);
    c.nseg = (c.n + SEG - 1) / SEG;
    c.sbb = I(5);
    c.sbk = I(6);
    c.sbn = I(7);
    c.r = (const float *)P(8);
    c.br = (float *)P(9);
    c.babs = (float *)P(10);
    c.hi = (float *)P(11);
    c.lo = (float *)P(12);
    double *agg = (double *)P(13);
    uint8_t *bad = (uint8_t *)P(14);
    int threads = (int)I(15);
    if (PyErr_Occurred()) return NULL;
    if (c.dt < 0 || c.dt > 2) {
        PyErr_SetString(PyExc_ValueError, "weight_side: bad dtype code");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = vabft_weight_side(&c, agg, bad, threads);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* check(m, n, k, nb0, nb1,
 *       a, adt, sa0, sa1, sam, sak,  c, cdt, sc0, sc1, scm, scn,
 *       bias, bdt, sb0, sb1, sbm, sbn,  r,  br, babs, sbr0, sbr1, sbrs,
 *       fm, fcm, fcs, fsp (fp64), sf0, sf1,
 *       scale, round, floor, cabs, csq, ccoh, alpha, beta, bias_round,
 *       vals (diff, thr: 2 planes), rows (mu, hi, lo: 3 planes), flags (ok, zero: 2 planes),
 *       threads) -> bool: every segment passed with D and T finite */
static PyObject *py_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 48) {
        PyErr_SetString(PyExc_TypeError, "check: expected 48 arguments");
        return NULL;
    }
    chk_ctx c;
    c.m = I(0);
    c.n = I(1);
    c.k = I(2);
    c.nb0 = I(3);
    c.nb1 = I(4);
    c.a = P(5);
    c.adt = (int)I(6);
    c.sa0 = I(7);
    c.sa1 = I(8);
    c.sam = I(9);
    c.sak = I(10);
    c.c = P(11);
    c.cdt = (int)I(12);
    c.sc0 = I(13);
    c.sc1 = I(14);
    c.scm = I(15);
    c.scn = I(16);
    c.bias = P(17);
    c.bdt = (int)I(18);
    c.sb0 = I(19);
    c.sb1 = I(20);
    c.sbm = I(21);
    c.sbn = I(22);
    c.r = (const float *)P(23);
    c.br = (const float *)P(24);
    c.babs = (const float *)P(25);
    c.sbr0 = I(26);
    c.sbr1 = I(27);
    c.sbrs = I(28);
    c.fm = (const double *)P(29);
    c.fcm = (const double *)P(30);
    c.fcs = (const double *)P(31);
    c.fsp = (const double *)P(32);
    c.sf0 = I(33);
    c.sf1 = I(34);
    c.scale = D(35);
    c.round = D(36);
    c.floor = D(37);
    c.cabs = D(38);
    c.csq = D(39);
    c.ccoh = D(40);
    c.alpha = F(41);
    c.beta = F(42);
    c.bias_round = F(43);
    float *vals = (float *)P(44), *rows = (float *)P(45);
    uint8_t *flags = (uint8_t *)P(46);
    int threads = (int)I(47);
    if (PyErr_Occurred()) return NULL;
    if (c.adt < 0 || c.adt > 2 || c.cdt < 0 || c.cdt > 2 || c.bdt < 0 || c.bdt > 2 || c.m <= 0 || c.k <= 0 ||
        c.n <= 0 || c.nb0 <= 0 || c.nb1 <= 0) {
        PyErr_SetString(PyExc_ValueError, "check: bad dtype code or empty operand");
        return NULL;
    }
    c.nseg = (c.n + SEG - 1) / SEG;
    /* the planes of native_call.py's output buffers */
    int64_t nb = c.nb0 * c.nb1, plane = nb * c.m * c.nseg;
    c.diff = vals;
    c.thr = vals + plane;
    c.mu = rows;
    c.hi = rows + nb * c.m;
    c.lo = rows + 2 * nb * c.m;
    c.ok = flags;
    c.zero = flags + plane;
    int rc;
    float worst;
    Py_BEGIN_ALLOW_THREADS
    rc = vabft_check(&c, threads, &worst);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    /* (every segment passed with D and T finite, largest D / T where that holds) */
    return Py_BuildValue("(Nd)", PyBool_FromLong(rc), (double)worst);
}

/* attn(bwd, isa, threads, b, hq, hkv, l, s, d, dv, causal,
 *      q, k, v, o, go, dq, dk, dv: 5 ints each (data, dtype, batch / head / row strides),
 *      mask, mdt, smb, smh, smi, out, flags, then AC_N floats) -> bool: every row passed.
 * The backward tensors are ignored (pass zeros) when bwd is 0. */
#define ATTN_FIXED (11 + 8 * 5 + 7)
static void tensor_arg(at_tensor *t, PyObject *const *args, int i) {
    t->p = P(i);
    t->dt = (int)I(i + 1);
    t->sb = I(i + 2);
    t->sh = I(i + 3);
    t->sr = I(i + 4);
}

static PyObject *py_attn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != ATTN_FIXED + AC_N) {
        PyErr_Format(PyExc_TypeError, "attn: expected %d arguments, received %zd", ATTN_FIXED + AC_N, nargs);
        return NULL;
    }
    attn_call c;
    int bwd = (int)I(0), threads = (int)I(2);
    c.isa = (int)I(1);
    c.b = I(3);
    c.hq = I(4);
    c.hkv = I(5);
    c.l = I(6);
    c.s = I(7);
    c.d = I(8);
    c.dv = I(9);
    c.causal = (int)I(10);
    at_tensor *ts[8] = {&c.q, &c.k, &c.v, &c.o, &c.go, &c.dq, &c.dk, &c.dvg};
    for (int t = 0; t < 8; t++) tensor_arg(ts[t], args, 11 + 5 * t);
    int a = 11 + 40;
    c.mask = P(a);
    c.mdt = (int)I(a + 1);
    c.smb = I(a + 2);
    c.smh = I(a + 3);
    c.smi = I(a + 4);
    c.out = (float *)P(a + 5);
    c.flags = (uint8_t *)P(a + 6);
    for (int i = 0; i < AC_N; i++) c.c[i] = D(ATTN_FIXED + i);
    if (PyErr_Occurred()) return NULL;
    int used = bwd ? 8 : 4;
    for (int t = 0; t < used; t++)
        if (ts[t]->dt < 0 || ts[t]->dt > 2) {
            PyErr_SetString(PyExc_ValueError, "attn: bad dtype code");
            return NULL;
        }
    if (c.b <= 0 || c.hkv <= 0 || c.hq <= 0 || c.hq % c.hkv || c.l <= 0 || c.s <= 0 || c.d <= 0 || c.dv <= 0 ||
        (c.mask && (c.mdt < 0 || c.mdt > 3))) {
        PyErr_SetString(PyExc_ValueError, "attn: bad shape or mask dtype code");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bwd ? vabft_attn_backward(&c, threads) : vabft_attn_forward(&c, threads);
    Py_END_ALLOW_THREADS
    if (rc == -1) return PyErr_NoMemory();
    if (rc == -2) {
        PyErr_Format(PyExc_ValueError, "attn: isa %d is not one this CPU runs", c.isa);
        return NULL;
    }
    return PyBool_FromLong(rc);
}

/* attn_exp(x, y, n, isa) -> None: y = exp(x) as the attention kernels of isa compute it */
static PyObject *py_attn_exp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "attn_exp: expected 4 arguments");
        return NULL;
    }
    const float *x = (const float *)P(0);
    float *y = (float *)P(1);
    int64_t n = I(2);
    int isa = (int)I(3);
    if (PyErr_Occurred()) return NULL;
    const attn_isa *k = vabft_attn_isa(isa);
    if (!k) {
        PyErr_Format(PyExc_ValueError, "attn_exp: isa %d is not one this CPU runs", isa);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    k->exp(x, y, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attn_isa(isa) -> str | None: the name of the attention kernels isa selects (0: the best
 * this CPU runs), None when this CPU cannot run them */
static PyObject *py_attn_isa(PyObject *self, PyObject *arg) {
    (void)self;
    long isa = PyLong_AsLong(arg);
    if (isa == -1 && PyErr_Occurred()) return NULL;
    const attn_isa *k = vabft_attn_isa((int)isa);
    if (!k) Py_RETURN_NONE;
    return PyUnicode_FromString(k->name);
}

/* noop(*args): the binding's own cost, for measuring the per-call overhead */
static PyObject *py_noop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    (void)nargs;
    Py_RETURN_NONE;
}

/* coll_sums(x, dt, n, rows, with_abs, out) -> None: a collective's segment sums (coll_sums.c).
 * The GIL stays held: this runs on the backend's thread, where giving it back means
 * waiting for the training thread to hand it over again; the call reads tens of
 * microseconds of data. */
static PyObject *py_coll_sums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "coll_sums: expected 6 arguments");
        return NULL;
    }
    const void *x = P(0);
    int dt = (int)I(1);
    int64_t n = I(2), rows = I(3);
    int with_abs = (int)I(4);
    double *out = (double *)P(5);
    if (PyErr_Occurred()) return NULL;
    if ((dt != DT_F32 && dt != DT_BF16) || n <= 0 || rows <= 0 || !x || !out) {
        PyErr_SetString(PyExc_ValueError, "coll_sums: bad dtype code, size or pointer");
        return NULL;
    }
    vabft_coll_sums(x, dt, n, rows, with_abs, out);
    Py_RETURN_NONE;
}

/* coll_bits(x, wide, words, rows, out) -> None: an all-gather shard's bit checksums
 * (coll_sums.c), the GIL held as in coll_sums */
static PyObject *py_coll_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "coll_bits: expected 5 arguments");
        return NULL;
    }
    const void *x = P(0);
    int wide = (int)I(1);
    int64_t words = I(2), rows = I(3);
    double *out = (double *)P(4);
    if (PyErr_Occurred()) return NULL;
    if (words < 0 || rows <= 0 || !out || (words > 0 && !x)) {
        PyErr_SetString(PyExc_ValueError, "coll_bits: bad size or pointer");
        return NULL;
    }
    vabft_coll_bits(x, wide, words, rows, out);
    Py_RETURN_NONE;
}

/* runtime() -> str: the path of the OpenMP runtime the kernels split work on, "" for pthreads */
static PyObject *py_runtime(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_DecodeFSDefault(vabft_runtime());
}

static PyMethodDef methods[] = {
    {"weight_side", (PyCFunction)(void (*)(void))py_weight_side, METH_FASTCALL, "V-ABFT weight side (native_call.py)"},
    {"check", (PyCFunction)(void (*)(void))py_check, METH_FASTCALL, "V-ABFT check (native_call.py)"},
    {"attn", (PyCFunction)(void (*)(void))py_attn, METH_FASTCALL, "attention screen (native_attention.py)"},
    {"attn_exp", (PyCFunction)(void (*)(void))py_attn_exp, METH_FASTCALL, "the attention kernels' exp (tests)"},
    {"attn_isa", (PyCFunction)py_attn_isa, METH_O, "the attention kernels an ISA code selects"},
    {"coll_sums", (PyCFunction)(void (*)(void))py_coll_sums, METH_FASTCALL, "a collective's segment sums (native.py)"},
    {"coll_bits", (PyCFunction)(void (*)(void))py_coll_bits, METH_FASTCALL, "an all-gather's bit checksums (native.py)"},
    {"runtime", (PyCFunction)(void (*)(void))py_runtime, METH_NOARGS, "the OpenMP runtime the kernels split work on"},
    {"noop", (PyCFunction)(void (*)(void))py_noop, METH_FASTCALL, "does nothing (overhead probe)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_vabft_cpu", "V-ABFT CPU kernels (sdc_guard.native)",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__vabft_cpu(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod) {
        PyModule_AddIntConstant(mod, "SEGMENT", SEG);
    }
    return mod;
}
