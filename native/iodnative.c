/* What Python cannot do well for iod: shared-memory segments with chosen
 * modes, acquire/release atomics on words in shared memory, and full preads
 * that run without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int get_word(PyObject *obj, Py_ssize_t offset, Py_ssize_t width,
                    int writable, Py_buffer *view, char **ptr) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (offset < 0 || offset % width != 0 || offset + width > view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "word offset out of range or unaligned");
        return -1;
    }
    *ptr = (char *)view->buf + offset;
    return 0;
}

static PyObject *load_acquire_u64(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "On", &obj, &off)) return NULL;
    if (get_word(obj, off, 8, 0, &v, &p) < 0) return NULL;
    uint64_t x = __atomic_load_n((uint64_t *)p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(x);
}

static PyObject *store_release_u64(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; unsigned long long x; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "OnK", &obj, &off, &x)) return NULL;
    if (get_word(obj, off, 8, 1, &v, &p) < 0) return NULL;
    __atomic_store_n((uint64_t *)p, (uint64_t)x, __ATOMIC_RELEASE);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyObject *load_acquire_u32(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "On", &obj, &off)) return NULL;
    if (get_word(obj, off, 4, 0, &v, &p) < 0) return NULL;
    uint32_t x = __atomic_load_n((uint32_t *)p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(x);
}

static PyObject *store_release_u32(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; unsigned long x; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "Onk", &obj, &off, &x)) return NULL;
    if (get_word(obj, off, 4, 1, &v, &p) < 0) return NULL;
    __atomic_store_n((uint32_t *)p, (uint32_t)x, __ATOMIC_RELEASE);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* pread_full(fd, buffer, buf_offset, nbytes, file_offset) -> bytes read.
 * Loops over short reads and EINTR; returns less than nbytes only at EOF. */
static PyObject *pread_full(PyObject *self, PyObject *args) {
    int fd; PyObject *obj; Py_ssize_t boff, n; long long foff; Py_buffer v;
    if (!PyArg_ParseTuple(args, "iOnnL", &fd, &obj, &boff, &n, &foff)) return NULL;
    if (PyObject_GetBuffer(obj, &v, PyBUF_WRITABLE) < 0) return NULL;
    if (boff < 0 || n < 0 || boff + n > v.len || foff < 0) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "read range out of buffer");
        return NULL;
    }
    char *dst = (char *)v.buf + boff;
    Py_ssize_t done = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (done < n) {
        ssize_t r = pread(fd, dst + done, (size_t)(n - done), (off_t)(foff + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) break;
        done += r;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(done);
}

/* shm_create(name, size) -> fd: a new segment, mode 0600, failing if it
 * exists (O_EXCL: a name someone else made is never adopted). On Linux its
 * pages are committed with posix_fallocate, so a segment /dev/shm or the
 * memory limit cannot hold fails here (ENOSPC, ENOMEM) instead of as a
 * SIGBUS on first touch; elsewhere (macOS) ftruncate sizes it as before. */
static PyObject *shm_create(PyObject *self, PyObject *args) {
    const char *name; long long size;
    if (!PyArg_ParseTuple(args, "sL", &name, &size)) return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        return NULL;
    }
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    /* the umask cannot widen 0600, but make the mode explicit anyway */
    int e = 0;
    if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)size) < 0) e = errno;
#ifdef __linux__
    while (!e && size > 0) {
        Py_BEGIN_ALLOW_THREADS
        e = posix_fallocate(fd, 0, (off_t)size);
        Py_END_ALLOW_THREADS
        if (e != EINTR) break;
        if (PyErr_CheckSignals() < 0) {  /* e.g. KeyboardInterrupt: give up */
            close(fd);
            shm_unlink(name);
            return NULL;
        }
        e = 0;  /* a signal we ignore: commit again */
    }
#endif
    if (e) {
        close(fd);
        shm_unlink(name);
        errno = e;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    }
    return PyLong_FromLong(fd);
}

/* shm_open_readonly(name) -> fd */
static PyObject *shm_open_readonly(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    return PyLong_FromLong(fd);
}

/* shm_unlink(name) -> bool: False when it did not exist. */
static PyObject *shm_unlink_(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (shm_unlink(name) < 0) {
        if (errno == ENOENT) Py_RETURN_FALSE;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"load_acquire_u64", load_acquire_u64, METH_VARARGS, "Acquire-load a u64 word."},
    {"store_release_u64", store_release_u64, METH_VARARGS, "Release-store a u64 word."},
    {"load_acquire_u32", load_acquire_u32, METH_VARARGS, "Acquire-load a u32 word."},
    {"store_release_u32", store_release_u32, METH_VARARGS, "Release-store a u32 word."},
    {"pread_full", pread_full, METH_VARARGS, "pread into a buffer without the GIL."},
    {"shm_create", shm_create, METH_VARARGS, "Create a 0600 POSIX shm segment."},
    {"shm_open_readonly", shm_open_readonly, METH_VARARGS, "Open a shm segment read-only."},
    {"shm_unlink", shm_unlink_, METH_VARARGS, "Unlink a shm segment."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "native._iodnative", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__iodnative(void) { return PyModule_Create(&module); }
