/* Byte-range copies between two host buffers in one call, without the GIL.
 *
 * The direct IO path computes every (layer, page) byte range of a job with numpy; copying them
 * from Python costs either one call per range (a GIL hand-off each, see direct.py) or a gather
 * into staging plus a scatter (two passes over memory). Here the whole job is one call: every
 * range is checked against both buffers first (nothing is copied if one is out of bounds), then
 * copied with memcpy while the GIL is released.
 *
 *   copy_ranges(src_addr, src_nbytes, dst_addr, dst_nbytes, src_off, dst_off, lengths)
 *
 * src_off / dst_off: int64 buffers (numpy arrays) of byte offsets; lengths: an int (every range
 * has that many bytes) or an int64 buffer of the same size. Ranges must not overlap between
 * source and destination (memcpy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* A job of at least this many bytes is written with non-temporal stores: it is larger than the
 * cache, so caching the destination only costs a read-for-ownership of every line (the C
 * library's memcpy switches to such stores only for single copies of several MiB, and a job is
 * many smaller ranges). */
#define STREAM_JOB_BYTES (1 << 20)

static void copy_one(char *dst, const char *src, size_t n, int stream) {
#if defined(__SSE2__)
    if (stream && n >= 128) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t blocks = n / 64;
        for (size_t b = 0; b < blocks; b++, dst += 64, src += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)src), x1 = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(src + 32)), x3 = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, x0);
            _mm_stream_si128((__m128i *)(dst + 16), x1);
            _mm_stream_si128((__m128i *)(dst + 32), x2);
            _mm_stream_si128((__m128i *)(dst + 48), x3);
        }
        memcpy(dst, src, n - blocks * 64);
        return;
    }
#endif
    memcpy(dst, src, n);
}

static int get_i64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "l") && strcmp(view->format, "q")
                                                         && strcmp(view->format, "<q") && strcmp(view->format, "<l")
                                                         && strcmp(view->format, "=q") && strcmp(view->format, "=l"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer, got format '%s'", what,
                     view->format ? view->format : "?");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_ranges(PyObject *self, PyObject *args) {
    unsigned long long src_addr, dst_addr;
    long long src_nbytes, dst_nbytes;
    PyObject *src_obj, *dst_obj, *len_obj;
    if (!PyArg_ParseTuple(args, "KLKLOOO", &src_addr, &src_nbytes, &dst_addr, &dst_nbytes, &src_obj, &dst_obj,
                          &len_obj))
        return NULL;
    Py_buffer sv, dv, lv;
    int have_lens = 0;
    long long fixed = 0;
    if (get_i64_buffer(src_obj, &sv, "src_off") < 0)
        return NULL;
    if (get_i64_buffer(dst_obj, &dv, "dst_off") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    if (PyLong_Check(len_obj)) {
        fixed = PyLong_AsLongLong(len_obj);
        if (fixed == -1 && PyErr_Occurred())
            goto fail;
    } else {
        if (get_i64_buffer(len_obj, &lv, "lengths") < 0)
            goto fail;
        have_lens = 1;
    }
    Py_ssize_t n = sv.len / 8;
    if (dv.len / 8 != n || (have_lens && lv.len / 8 != n)) {
        PyErr_SetString(PyExc_ValueError, "src_off, dst_off and lengths must have the same number of ranges");
        goto fail;
    }
    const int64_t *so = (const int64_t *)sv.buf, *dof = (const int64_t *)dv.buf;
    const int64_t *ln = have_lens ? (const int64_t *)lv.buf : NULL;
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t len = ln ? ln[i] : fixed;
        total += len;
        if (len < 0 || so[i] < 0 || dof[i] < 0 || so[i] > src_nbytes - len || dof[i] > dst_nbytes - len) {
            PyErr_Format(PyExc_ValueError,
                         "range %zd (src %lld, dst %lld, %lld bytes) is outside the buffers (%lld, %lld bytes)", i,
                         (long long)so[i], (long long)dof[i], (long long)len, src_nbytes, dst_nbytes);
            goto fail;
        }
    }
    char *src = (char *)(uintptr_t)src_addr, *dst = (char *)(uintptr_t)dst_addr;
    int stream = total >= STREAM_JOB_BYTES;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        copy_one(dst + dof[i], src + so[i], (size_t)(ln ? ln[i] : fixed), stream);
#if defined(__SSE2__)
    _mm_sfence(); /* streamed stores are visible to other threads before we return */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    if (have_lens)
        PyBuffer_Release(&lv);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    if (have_lens)
        PyBuffer_Release(&lv);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy_ranges", copy_ranges, METH_VARARGS,
     "copy_ranges(src_addr, src_nbytes, dst_addr, dst_nbytes, src_off, dst_off, lengths): memcpy every "
     "byte range (bounds-checked first) with the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Native host copies for kvcacheio.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
