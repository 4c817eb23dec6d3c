/* Batched file I/O and payload hashing for the L3 backends, without the GIL.
 *
 * A batch of pages at 64 KiB costs ~15 us per page in the kernel (open, copy, close) and, done
 * object by object from Python, as much again in interpreter work and GIL hand-offs. These calls
 * take a whole batch at once: the paths as a list of str and the host memory of every object as
 * flat int64 arrays (iovec addresses and lengths, and ``starts``: object i owns iovecs
 * starts[i] .. starts[i+1]). Python computes the addresses from the host pool's buffers and
 * checks them; this file trusts them.
 *
 * Payload checksums are XXH3-64, computed right after an object is read (while it is still in
 * the cache) by the xxhash package's own compiled functions, resolved at run time from its
 * extension module (bind_xxh3); nothing is hashed until that succeeded.
 *
 * Per-object results are written into caller-provided int64 / uint64 arrays: a byte count, or
 * -errno when the object could not be opened, read or written.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#ifndef O_NOATIME
#define O_NOATIME 0
#endif

typedef uint64_t (*xxh3_oneshot_t)(const void *, size_t);
typedef void *(*xxh3_create_t)(void);
typedef int (*xxh3_free_t)(void *);
typedef int (*xxh3_reset_t)(void *);
typedef int (*xxh3_update_t)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_t)(const void *);

static struct {
    xxh3_oneshot_t oneshot;
    xxh3_create_t create;
    xxh3_free_t release;
    xxh3_reset_t reset;
    xxh3_update_t update;
    xxh3_digest_t digest;
} xxh3;

/* ---- argument helpers --------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    Py_ssize_t n;
    int held;
} i64buf;

static int get_i64(PyObject *obj, i64buf *b, const char *what, int writable) {
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "?";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (b->view.itemsize != 8 || strlen(f) != 1 || !strchr("lqLQ", *f)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous 64-bit integer array, got format '%s'", what,
                     b->view.format ? b->view.format : "?");
        return -1;
    }
    b->n = b->view.len / 8;
    return 0;
}

static void release(i64buf *bufs, int count) {
    for (int i = 0; i < count; i++)
        if (bufs[i].held)
            PyBuffer_Release(&bufs[i].view);
}

/* UTF-8 pointers of a list of str, kept alive by a reference to each item (the caller's list
 * may change while the GIL is released). */
typedef struct {
    PyObject **items;
    const char **paths;
    Py_ssize_t n;
} pathlist;

static int get_paths(PyObject *list, pathlist *p, const char *what) {
    p->items = NULL, p->paths = NULL, p->n = 0;
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of str", what);
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    p->items = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    p->paths = PyMem_Calloc(n ? n : 1, sizeof(char *));
    if (!p->items || !p->paths) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(list, i);
        if (!PyUnicode_Check(s)) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] is not a str", what, i);
            return -1;
        }
        Py_INCREF(s);
        p->items[i] = s, p->n = i + 1;
        p->paths[i] = PyUnicode_AsUTF8(s);
        if (!p->paths[i])
            return -1;
    }
    return 0;
}

static void free_paths(pathlist *p) {
    for (Py_ssize_t i = 0; i < p->n; i++)
        Py_DECREF(p->items[i]);
    PyMem_Free(p->items);
    PyMem_Free(p->paths);
}

/* starts must be non-decreasing from 0 to the number of iovecs, one more entry than objects. */
static int check_layout(const i64buf *addrs, const i64buf *lens, const i64buf *starts, Py_ssize_t objects) {
    if (addrs->n != lens->n) {
        PyErr_Format(PyExc_ValueError, "addrs has %zd entries, lens %zd", addrs->n, lens->n);
        return -1;
    }
    const int64_t *st = (const int64_t *)starts->view.buf, *ln = (const int64_t *)lens->view.buf;
    if (starts->n != objects + 1 || st[0] != 0 || st[objects] != addrs->n) {
        PyErr_Format(PyExc_ValueError, "starts must have %zd entries from 0 to %zd", objects + 1, addrs->n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < objects; i++)
        if (st[i + 1] < st[i]) {
            PyErr_Format(PyExc_ValueError, "starts decreases at object %zd", i);
            return -1;
        }
    for (Py_ssize_t i = 0; i < lens->n; i++)
        if (ln[i] < 0) {
            PyErr_Format(PyExc_ValueError, "lens[%zd] is negative", i);
            return -1;
        }
    return 0;
}

/* ---- the work, with the GIL released -------------------------------------------------------- */

/* Fill ``count`` iovecs from addrs/lens[first...]; returns their total length. */
static int64_t fill_iov(struct iovec *iov, const int64_t *addrs, const int64_t *lens, int64_t first, int64_t count) {
    int64_t total = 0;
    for (int64_t j = 0; j < count; j++) {
        iov[j].iov_base = (void *)(uintptr_t)addrs[first + j];
        iov[j].iov_len = (size_t)lens[first + j];
        total += lens[first + j];
    }
    return total;
}

/* Read or write ``count`` iovecs at file offset 0, IOV_MAX at a time, continuing after short
 * writes; a read stops at the first short transfer (end of file). Bytes moved, or -errno. */
static int64_t move_all(int fd, struct iovec *iov, int64_t count, int write) {
    int64_t done = 0;
    while (count > 0) {
        int batch = count > IOV_MAX ? IOV_MAX : (int)count;
        size_t want = 0;
        for (int j = 0; j < batch; j++)
            want += iov[j].iov_len;
        ssize_t got = write ? pwritev(fd, iov, batch, done) : preadv(fd, iov, batch, done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        done += got;
        if ((size_t)got == want) {
            iov += batch, count -= batch;
            continue;
        }
        if (!write || got == 0)
            return write ? -EIO : done;
        /* a short write: skip what went out and go on */
        size_t left = (size_t)got;
        while (left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++, count--;
        }
        iov->iov_base = (char *)iov->iov_base + left;
        iov->iov_len -= left;
    }
    return done;
}

/* XXH3-64 of the bytes of ``count`` iovecs (of nothing when count is 0). */
static uint64_t hash_iov(const struct iovec *iov, int64_t count, void *state) {
    if (count == 0)
        return xxh3.oneshot("", 0);
    if (count == 1)
        return xxh3.oneshot(iov[0].iov_base, iov[0].iov_len);
    xxh3.reset(state);
    for (int64_t j = 0; j < count; j++)
        xxh3.update(state, iov[j].iov_base, iov[j].iov_len);
    return xxh3.digest(state);
}

static int open_retry(const char *path, int flags, int mode) {
    int fd;
    do
        fd = open(path, flags, mode);
    while (fd < 0 && errno == EINTR);
    if (fd < 0 && errno == EPERM && (flags & O_NOATIME)) /* O_NOATIME on a file of another owner */
        return open_retry(path, flags & ~O_NOATIME, mode);
    return fd;
}

static int64_t max_iovs(const int64_t *st, Py_ssize_t objects) {
    int64_t most = 1;
    for (Py_ssize_t i = 0; i < objects; i++)
        if (st[i + 1] - st[i] + 1 > most)
            most = st[i + 1] - st[i] + 1;
    return most;
}

/* ---- bind_xxh3 ------------------------------------------------------------------------------ */

static PyObject *bind_xxh3(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        PyErr_Format(PyExc_OSError, "dlopen %s: %s", path, dlerror());
        return NULL;
    }
    void *sym[6];
    const char *names[6] = {"XXH3_64bits", "XXH3_createState", "XXH3_freeState",
                            "XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest"};
    for (int i = 0; i < 6; i++) {
        sym[i] = dlsym(lib, names[i]);
        if (!sym[i]) {
            PyErr_Format(PyExc_OSError, "%s does not export %s", path, names[i]);
            dlclose(lib);
            return NULL;
        }
    }
    /* the library stays loaded (the xxhash module holds it anyway) */
    xxh3.oneshot = (xxh3_oneshot_t)sym[0], xxh3.create = (xxh3_create_t)sym[1];
    xxh3.release = (xxh3_free_t)sym[2], xxh3.reset = (xxh3_reset_t)sym[3];
    xxh3.update = (xxh3_update_t)sym[4], xxh3.digest = (xxh3_digest_t)sym[5];
    Py_RETURN_NONE;
}

static int need_hash(void) {
    if (xxh3.oneshot)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "bind_xxh3() has not succeeded; no hash function");
    return -1;
}

/* ---- hash_iovs(addrs, lens, starts, out_sums) ------------------------------------------------- */

static PyObject *hash_iovs(PyObject *self, PyObject *args) {
    PyObject *a, *l, *s, *o;
    if (!PyArg_ParseTuple(args, "OOOO", &a, &l, &s, &o))
        return NULL;
    i64buf b[4];
    memset(b, 0, sizeof(b));
    PyObject *ret = NULL;
    if (need_hash() < 0 || get_i64(a, &b[0], "addrs", 0) < 0 || get_i64(l, &b[1], "lens", 0) < 0 ||
        get_i64(s, &b[2], "starts", 0) < 0 || get_i64(o, &b[3], "out_sums", 1) < 0)
        goto done;
    Py_ssize_t objects = b[3].n;
    if (check_layout(&b[0], &b[1], &b[2], objects) < 0)
        goto done;
    const int64_t *addrs = b[0].view.buf, *lens = b[1].view.buf, *st = b[2].view.buf;
    uint64_t *out = b[3].view.buf;
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * max_iovs(st, objects));
    void *state = xxh3.create();
    if (!iov || !state) {
        PyMem_Free(iov);
        if (state)
            xxh3.release(state);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < objects; i++) {
        int64_t n = st[i + 1] - st[i];
        fill_iov(iov, addrs, lens, st[i], n);
        out[i] = hash_iov(iov, n, state);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    xxh3.release(state);
    ret = Py_NewRef(Py_None);
done:
    release(b, 4);
    return ret;
}

/* ---- read_files(paths, flags, addrs, lens, starts, tails_addr, tail_stride, tail_len,
 *                 trailer_bytes, hash, out_counts, out_sums) ------------------------------------
 * Object i: open paths[i] with ``flags``, preadv its payload iovecs followed by
 * tail_len bytes at tails_addr + i * tail_stride, close. out_counts[i]: bytes read, or -errno
 * (-ENOENT: absent). With ``hash``, out_sums[i] is the payload's XXH3-64 when exactly
 * payload + trailer_bytes bytes were read (a whole object), else 0. */

static PyObject *read_files(PyObject *self, PyObject *args) {
    PyObject *plist, *a, *l, *s, *oc, *os_;
    int flags, hash;
    unsigned long long tails_addr;
    long long tail_stride, tail_len, trailer_bytes;
    if (!PyArg_ParseTuple(args, "OiOOOKLLLpOO", &plist, &flags, &a, &l, &s, &tails_addr, &tail_stride, &tail_len,
                          &trailer_bytes, &hash, &oc, &os_))
        return NULL;
    i64buf b[5];
    memset(b, 0, sizeof(b));
    pathlist p = {0};
    PyObject *ret = NULL;
    if ((hash && need_hash() < 0) || get_paths(plist, &p, "paths") < 0 || get_i64(a, &b[0], "addrs", 0) < 0 ||
        get_i64(l, &b[1], "lens", 0) < 0 || get_i64(s, &b[2], "starts", 0) < 0 ||
        get_i64(oc, &b[3], "out_counts", 1) < 0 || get_i64(os_, &b[4], "out_sums", 1) < 0)
        goto done;
    Py_ssize_t objects = p.n;
    if (b[3].n != objects || b[4].n != objects) {
        PyErr_SetString(PyExc_ValueError, "out_counts and out_sums need one entry per path");
        goto done;
    }
    if (check_layout(&b[0], &b[1], &b[2], objects) < 0)
        goto done;
    if (tail_len < 0 || tail_stride < tail_len || trailer_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= tail_len <= tail_stride and trailer_bytes >= 0");
        goto done;
    }
    const int64_t *addrs = b[0].view.buf, *lens = b[1].view.buf, *st = b[2].view.buf;
    int64_t *counts = b[3].view.buf;
    uint64_t *sums = b[4].view.buf;
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * max_iovs(st, objects));
    void *state = hash ? xxh3.create() : NULL;
    if (!iov || (hash && !state)) {
        PyMem_Free(iov);
        if (state)
            xxh3.release(state);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < objects; i++) {
        int64_t n = st[i + 1] - st[i];
        sums[i] = 0;
        int fd = open_retry(p.paths[i], flags, 0);
        if (fd < 0) {
            counts[i] = -errno;
            continue;
        }
        int64_t payload = fill_iov(iov, addrs, lens, st[i], n);
        iov[n].iov_base = (void *)(uintptr_t)(tails_addr + (uint64_t)(i * tail_stride));
        iov[n].iov_len = (size_t)tail_len;
        counts[i] = move_all(fd, iov, n + 1, 0);
        close(fd);
        if (hash && counts[i] == payload + trailer_bytes) /* a read leaves the iovecs as they were */
            sums[i] = hash_iov(iov, n, state);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    if (state)
        xxh3.release(state);
    ret = Py_NewRef(Py_None);
done:
    free_paths(&p);
    release(b, 5);
    return ret;
}

/* ---- write_files(tmp_paths, final_paths, flags, addrs, lens, starts, out_errs) -----------------
 * Object i: create tmp_paths[i] (O_WRONLY | O_CREAT | O_EXCL | flags, mode 0644), write its
 * iovecs at offset 0 (all of them), close, rename over final_paths[i]. out_errs[i]: 0, or
 * -errno (the temporary file is removed then). */

static PyObject *write_files(PyObject *self, PyObject *args) {
    PyObject *tlist, *flist, *a, *l, *s, *oe;
    int flags;
    if (!PyArg_ParseTuple(args, "OOiOOOO", &tlist, &flist, &flags, &a, &l, &s, &oe))
        return NULL;
    i64buf b[4];
    memset(b, 0, sizeof(b));
    pathlist tp = {0}, fp = {0};
    PyObject *ret = NULL;
    if (get_paths(tlist, &tp, "tmp_paths") < 0 || get_paths(flist, &fp, "final_paths") < 0 ||
        get_i64(a, &b[0], "addrs", 0) < 0 || get_i64(l, &b[1], "lens", 0) < 0 || get_i64(s, &b[2], "starts", 0) < 0 ||
        get_i64(oe, &b[3], "out_errs", 1) < 0)
        goto done;
    Py_ssize_t objects = tp.n;
    if (fp.n != objects || b[3].n != objects) {
        PyErr_SetString(PyExc_ValueError, "tmp_paths, final_paths and out_errs need one entry per object");
        goto done;
    }
    if (check_layout(&b[0], &b[1], &b[2], objects) < 0)
        goto done;
    const int64_t *addrs = b[0].view.buf, *lens = b[1].view.buf, *st = b[2].view.buf;
    int64_t *errs = b[3].view.buf;
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * max_iovs(st, objects));
    if (!iov) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < objects; i++) {
        int64_t n = st[i + 1] - st[i];
        int fd = open_retry(tp.paths[i], O_WRONLY | O_CREAT | O_EXCL | flags, 0644);
        if (fd < 0) {
            errs[i] = -errno;
            continue;
        }
        int64_t total = fill_iov(iov, addrs, lens, st[i], n);
        int64_t wrote = move_all(fd, iov, n, 1);
        int err = wrote < 0 ? (int)-wrote : (wrote != total ? EIO : 0);
        if (close(fd) < 0 && !err)
            err = errno;
        if (!err && rename(tp.paths[i], fp.paths[i]) < 0)
            err = errno;
        if (err)
            unlink(tp.paths[i]);
        errs[i] = -err;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    ret = Py_NewRef(Py_None);
done:
    free_paths(&tp);
    free_paths(&fp);
    release(b, 4);
    return ret;
}

/* ---- open_files(paths, flags, mode, out_fds, out_sizes) ---------------------------------------
 * out_fds[i]: an open descriptor or -errno; out_sizes[i]: its size (fstat), -1 when not open. */

static PyObject *open_files(PyObject *self, PyObject *args) {
    PyObject *plist, *ofd, *osz;
    int flags, mode;
    if (!PyArg_ParseTuple(args, "OiiOO", &plist, &flags, &mode, &ofd, &osz))
        return NULL;
    i64buf b[2];
    memset(b, 0, sizeof(b));
    pathlist p = {0};
    PyObject *ret = NULL;
    if (get_paths(plist, &p, "paths") < 0 || get_i64(ofd, &b[0], "out_fds", 1) < 0 ||
        get_i64(osz, &b[1], "out_sizes", 1) < 0)
        goto done;
    if (b[0].n != p.n || b[1].n != p.n) {
        PyErr_SetString(PyExc_ValueError, "out_fds and out_sizes need one entry per path");
        goto done;
    }
    int64_t *fds = b[0].view.buf, *sizes = b[1].view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < p.n; i++) {
        int fd = open_retry(p.paths[i], flags, mode);
        struct stat sb;
        sizes[i] = -1;
        if (fd < 0) {
            fds[i] = -errno;
        } else if (fstat(fd, &sb) < 0) {
            fds[i] = -errno;
            close(fd);
        } else {
            fds[i] = fd, sizes[i] = sb.st_size;
        }
    }
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    free_paths(&p);
    release(b, 2);
    return ret;
}

/* ---- close_files(fds): close every descriptor >= 0 ----------------------------------------------- */

static PyObject *close_files(PyObject *self, PyObject *args) {
    PyObject *o;
    if (!PyArg_ParseTuple(args, "O", &o))
        return NULL;
    i64buf b;
    if (get_i64(o, &b, "fds", 0) < 0) {
        release(&b, 1);
        return NULL;
    }
    const int64_t *fds = b.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b.n; i++)
        if (fds[i] >= 0)
            close((int)fds[i]);
    Py_END_ALLOW_THREADS
    release(&b, 1);
    Py_RETURN_NONE;
}

/* ---- rename_files(src, dst, out_errs) / unlink_files(paths) ------------------------------------- */

static PyObject *rename_files(PyObject *self, PyObject *args) {
    PyObject *sl, *dl, *oe;
    if (!PyArg_ParseTuple(args, "OOO", &sl, &dl, &oe))
        return NULL;
    pathlist sp = {0}, dp = {0};
    i64buf b;
    memset(&b, 0, sizeof(b));
    PyObject *ret = NULL;
    if (get_paths(sl, &sp, "src") < 0 || get_paths(dl, &dp, "dst") < 0 || get_i64(oe, &b, "out_errs", 1) < 0)
        goto done;
    if (dp.n != sp.n || b.n != sp.n) {
        PyErr_SetString(PyExc_ValueError, "src, dst and out_errs need the same length");
        goto done;
    }
    int64_t *errs = b.view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < sp.n; i++)
        errs[i] = rename(sp.paths[i], dp.paths[i]) < 0 ? -errno : 0;
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    free_paths(&sp);
    free_paths(&dp);
    release(&b, 1);
    return ret;
}

static PyObject *unlink_files(PyObject *self, PyObject *args) {
    PyObject *pl;
    if (!PyArg_ParseTuple(args, "O", &pl))
        return NULL;
    pathlist p = {0};
    if (get_paths(pl, &p, "paths") < 0) {
        free_paths(&p);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < p.n; i++)
        unlink(p.paths[i]);
    Py_END_ALLOW_THREADS
    free_paths(&p);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind_xxh3", bind_xxh3, METH_VARARGS, "bind_xxh3(path): resolve XXH3-64 from the xxhash extension at path."},
    {"hash_iovs", hash_iovs, METH_VARARGS, "hash_iovs(addrs, lens, starts, out_sums): XXH3-64 of each object."},
    {"read_files", read_files, METH_VARARGS,
     "read_files(paths, flags, addrs, lens, starts, tails_addr, tail_stride, tail_len, trailer_bytes, hash, "
     "out_counts, out_sums): open, preadv payload + tail, close, hash whole objects."},
    {"write_files", write_files, METH_VARARGS,
     "write_files(tmp_paths, final_paths, flags, addrs, lens, starts, out_errs): create, pwritev, close, rename."},
    {"open_files", open_files, METH_VARARGS, "open_files(paths, flags, mode, out_fds, out_sizes)."},
    {"close_files", close_files, METH_VARARGS, "close_files(fds): close every fd >= 0."},
    {"rename_files", rename_files, METH_VARARGS, "rename_files(src, dst, out_errs)."},
    {"unlink_files", unlink_files, METH_VARARGS, "unlink_files(paths): best effort."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_files",
                                    "Batched file I/O and XXH3 hashing for the L3 backends.", -1, methods};

PyMODINIT_FUNC PyInit__native_files(void) {
    PyObject *m = PyModule_Create(&module);
    if (m) {
        PyModule_AddIntConstant(m, "IOV_MAX", IOV_MAX);
        PyModule_AddIntConstant(m, "O_NOATIME", O_NOATIME);
    }
    return m;
}
