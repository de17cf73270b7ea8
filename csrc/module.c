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
 *       scale, round, floor, alpha, beta, bias_round,
 *       vals (diff, thr: 2 planes), rows (mu, hi, lo: 3 planes), flags (ok, zero: 2 planes),
 *       threads) -> bool: every segment passed with D and T finite */
static PyObject *py_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 45) {
        PyErr_SetString(PyExc_TypeError, "check: expected 45 arguments");
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
    c.alpha = F(38);
    c.beta = F(39);
    c.bias_round = F(40);
    float *vals = (float *)P(41), *rows = (float *)P(42);
    uint8_t *flags = (uint8_t *)P(43);
    int threads = (int)I(44);
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

/* noop(*args): the binding's own cost, for measuring the per-call overhead */
static PyObject *py_noop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    (void)nargs;
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
