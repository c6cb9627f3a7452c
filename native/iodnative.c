/* What Python cannot do well for iod: shared-memory segments with chosen
 * modes, acquire/release atomics on words in shared memory, and full preads
 * that run without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
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

/* Atomics on shared words, all sequentially consistent: pinning a slot and
 * evicting it are a Dekker-style handshake (each side writes its word, then
 * reads the other's), which needs store->load ordering on every CPU. */
static PyObject *load_u64(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "On", &obj, &off)) return NULL;
    if (get_word(obj, off, 8, 0, &v, &p) < 0) return NULL;
    uint64_t x = __atomic_load_n((uint64_t *)p, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(x);
}

static PyObject *store_u64(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; unsigned long long x; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "OnK", &obj, &off, &x)) return NULL;
    if (get_word(obj, off, 8, 1, &v, &p) < 0) return NULL;
    __atomic_store_n((uint64_t *)p, (uint64_t)x, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static PyObject *load_u32(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "On", &obj, &off)) return NULL;
    if (get_word(obj, off, 4, 0, &v, &p) < 0) return NULL;
    uint32_t x = __atomic_load_n((uint32_t *)p, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(x);
}

static PyObject *store_u32(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; unsigned long x; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "Onk", &obj, &off, &x)) return NULL;
    if (get_word(obj, off, 4, 1, &v, &p) < 0) return NULL;
    __atomic_store_n((uint32_t *)p, (uint32_t)x, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* wait_u32(buffer, offset, value, spin_s, timeout_s) -> whether the word
 * became ``value``: polled (seq_cst) for spin_s, then every 20 us until
 * timeout_s, without the GIL, so a thread waiting for a GPU's post leaves
 * the interpreter to the thread that queues the GPU's work. */
static PyObject *wait_u32(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; unsigned long want; double spin_s, timeout_s;
    Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "Onkdd", &obj, &off, &want, &spin_s, &timeout_s)) return NULL;
    if (get_word(obj, off, 4, 0, &v, &p) < 0) return NULL;
    int seen = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec t0, now, nap = {0, 20000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (__atomic_load_n((uint32_t *)p, __ATOMIC_SEQ_CST) == (uint32_t)want) { seen = 1; break; }
        clock_gettime(CLOCK_MONOTONIC, &now);
        double dt = (double)(now.tv_sec - t0.tv_sec) + (now.tv_nsec - t0.tv_nsec) * 1e-9;
        if (dt > timeout_s) break;
        if (dt > spin_s) nanosleep(&nap, NULL);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyBool_FromLong(seen);
}

/* add_u32(buffer, offset, delta) -> the word's new value */
static PyObject *add_u32(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t off; long delta; Py_buffer v; char *p;
    if (!PyArg_ParseTuple(args, "Onl", &obj, &off, &delta)) return NULL;
    if (get_word(obj, off, 4, 1, &v, &p) < 0) return NULL;
    uint32_t x = __atomic_add_fetch((uint32_t *)p, (uint32_t)delta, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(x);
}

/* Slot header fields (shared/slots.py SLOT_HEADER). */
#define HDR_MODEL 4
#define HDR_LAYER 8
#define HDR_EXPERT 12
#define HDR_GENERATION 16

/* pin_ready(arena, pins, dir_offset, header_offset, slot_count, pin_offset,
 *           ref_offset, model, layer, experts, slots_out, gens_out) -> hits
 *
 * For each expert (int32 array): look its slot up in the arena's directory
 * (u32 words at dir_offset + 4 * expert: slot + 1, 0 = none), pin it by one
 * in this session's pin row (u32 at pin_offset + 4 * slot), then re-read the
 * slot's generation: unchanged and naming (model, layer, expert) means the
 * daemon cannot have evicted it, since it re-checks pins after zeroing the
 * generation. Writes the slot (or -1) and generation per expert, marks each
 * hit's reference byte (ref_offset + slot) for the daemon's CLOCK sweep.
 * No system call, no message. */
static PyObject *pin_ready(PyObject *self, PyObject *args) {
    PyObject *arena_o, *pins_o, *experts_o, *slots_o, *gens_o;
    Py_ssize_t dir_off, hdr_off, slot_count, pin_off, ref_off;
    unsigned long model, layer;
    if (!PyArg_ParseTuple(args, "OOnnnnnkkOOO", &arena_o, &pins_o, &dir_off, &hdr_off,
                          &slot_count, &pin_off, &ref_off, &model, &layer, &experts_o,
                          &slots_o, &gens_o))
        return NULL;
    Py_buffer a, p, e, s, g;
    if (PyObject_GetBuffer(arena_o, &a, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(pins_o, &p, PyBUF_WRITABLE) < 0) { PyBuffer_Release(&a); return NULL; }
    if (PyObject_GetBuffer(experts_o, &e, PyBUF_SIMPLE) < 0) goto fail2;
    if (PyObject_GetBuffer(slots_o, &s, PyBUF_WRITABLE) < 0) goto fail3;
    if (PyObject_GetBuffer(gens_o, &g, PyBUF_WRITABLE) < 0) goto fail4;
    Py_ssize_t n = e.len / 4;
    if (s.len < n * 4 || g.len < n * 8 || slot_count <= 0 ||
        hdr_off < 0 || hdr_off + 64 * slot_count > a.len || dir_off < 0 ||
        pin_off < 0 || pin_off + 4 * slot_count > p.len || ref_off < 0 ||
        ref_off + slot_count > p.len) {
        PyErr_SetString(PyExc_ValueError, "pin_ready: offsets out of range");
        goto fail5;
    }
    const int32_t *ex = (const int32_t *)e.buf;
    int32_t *out = (int32_t *)s.buf;
    uint64_t *gens = (uint64_t *)g.buf;
    char *arena = (char *)a.buf, *pins = (char *)p.buf;
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = -1;
        gens[i] = 0;
        Py_ssize_t d = dir_off + 4 * (Py_ssize_t)ex[i];
        if (ex[i] < 0 || d + 4 > a.len) continue;
        uint32_t idx = __atomic_load_n((uint32_t *)(arena + d), __ATOMIC_SEQ_CST);
        if (idx == 0 || (Py_ssize_t)idx > slot_count) continue;
        Py_ssize_t slot = idx - 1;
        char *h = arena + hdr_off + 64 * slot;
        uint64_t gen = __atomic_load_n((uint64_t *)(h + HDR_GENERATION), __ATOMIC_SEQ_CST);
        if (gen == 0) continue;
        uint32_t *pin = (uint32_t *)(pins + pin_off + 4 * slot);
        __atomic_add_fetch(pin, 1, __ATOMIC_SEQ_CST);
        uint64_t again = __atomic_load_n((uint64_t *)(h + HDR_GENERATION), __ATOMIC_SEQ_CST);
        if (again != gen || *(uint32_t *)(h + HDR_MODEL) != model ||
            *(uint32_t *)(h + HDR_LAYER) != layer || *(uint32_t *)(h + HDR_EXPERT) != (uint32_t)ex[i]) {
            __atomic_sub_fetch(pin, 1, __ATOMIC_SEQ_CST);
            continue;
        }
        __atomic_store_n((uint8_t *)(pins + ref_off + slot), 1, __ATOMIC_RELAXED);
        out[i] = (int32_t)slot;
        gens[i] = gen;
        hits++;
    }
    PyBuffer_Release(&g); PyBuffer_Release(&s); PyBuffer_Release(&e);
    PyBuffer_Release(&p); PyBuffer_Release(&a);
    return PyLong_FromSsize_t(hits);
fail5: PyBuffer_Release(&g);
fail4: PyBuffer_Release(&s);
fail3: PyBuffer_Release(&e);
fail2: PyBuffer_Release(&p); PyBuffer_Release(&a);
    return NULL;
}

/* unpin(pins, pin_offset, slot_count, slots) -> unpinned: drop one pin per
 * slot >= 0 (int32 array) of this session's row. */
static PyObject *unpin(PyObject *self, PyObject *args) {
    PyObject *pins_o, *slots_o; Py_ssize_t pin_off, slot_count; Py_buffer p, s;
    if (!PyArg_ParseTuple(args, "OnnO", &pins_o, &pin_off, &slot_count, &slots_o)) return NULL;
    if (PyObject_GetBuffer(pins_o, &p, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(slots_o, &s, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&p); return NULL; }
    if (pin_off < 0 || pin_off + 4 * slot_count > p.len) {
        PyBuffer_Release(&s); PyBuffer_Release(&p);
        PyErr_SetString(PyExc_ValueError, "unpin: row out of range");
        return NULL;
    }
    const int32_t *sl = (const int32_t *)s.buf;
    Py_ssize_t n = s.len / 4, done = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sl[i] < 0 || sl[i] >= slot_count) continue;
        uint32_t *pin = (uint32_t *)((char *)p.buf + pin_off + 4 * (Py_ssize_t)sl[i]);
        /* never below zero: a row the daemon cleared (session ended) stays clear */
        uint32_t old = __atomic_load_n(pin, __ATOMIC_SEQ_CST);
        while (old > 0 && !__atomic_compare_exchange_n(pin, &old, old - 1, 0,
                                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
        if (old > 0) done++;
    }
    PyBuffer_Release(&s); PyBuffer_Release(&p);
    return PyLong_FromSsize_t(done);
}

/* pinned(pins, row_bytes, rows, slot) -> the pin count of ``slot`` summed
 * over every row: the daemon's second look after it unpublished the slot. */
static PyObject *pinned(PyObject *self, PyObject *args) {
    PyObject *pins_o; Py_ssize_t row_bytes, rows, slot; Py_buffer p;
    if (!PyArg_ParseTuple(args, "Onnn", &pins_o, &row_bytes, &rows, &slot)) return NULL;
    if (PyObject_GetBuffer(pins_o, &p, PyBUF_SIMPLE) < 0) return NULL;
    if (slot < 0 || rows < 0 || row_bytes < 4 * (slot + 1) || row_bytes * rows > p.len) {
        PyBuffer_Release(&p);
        PyErr_SetString(PyExc_ValueError, "pinned: out of range");
        return NULL;
    }
    unsigned long long total = 0;
    for (Py_ssize_t r = 0; r < rows; r++)
        total += __atomic_load_n((uint32_t *)((char *)p.buf + r * row_bytes + 4 * slot),
                                 __ATOMIC_SEQ_CST);
    PyBuffer_Release(&p);
    return PyLong_FromUnsignedLongLong(total);
}

/* 16-bit floats widened to float32 on the way (a model stored in bfloat16
 * or float16, computed in float32 on a CPU): exact, as MLX's astype. */
static inline uint32_t bf16_to_f32_bits(uint16_t h) { return (uint32_t)h << 16; }

static inline uint32_t f16_to_f32_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return sign | 0x7f800000u | (man << 13);  /* inf, nan */
    if (exp != 0) return sign | ((exp + 112u) << 23) | (man << 13);
    if (man == 0) return sign;  /* zero */
    exp = 113u;  /* subnormal: normalize */
    while (!(man & 0x400u)) { man <<= 1; exp--; }
    return sign | (exp << 23) | ((man & 0x3ffu) << 13);
}

enum { COPY = 0, BF16_TO_F32 = 1, F16_TO_F32 = 2 };

static void widen(char *dst, const char *src, int64_t n, int kind) {
    const uint16_t *s = (const uint16_t *)src;
    uint32_t *d = (uint32_t *)dst;
    int64_t count = n / 2;
    if (kind == BF16_TO_F32)
        for (int64_t i = 0; i < count; i++) d[i] = bf16_to_f32_bits(s[i]);
    else
        for (int64_t i = 0; i < count; i++) d[i] = f16_to_f32_bits(s[i]);
}

/* copy_regions(dsts, src, plan, kind=0) -> source bytes copied. plan: int64
 * rows of (dst index, dst offset, src offset, nbytes of source); one call
 * copies a layer's records into its tensors, without the GIL. kind 1 / 2
 * widens bfloat16 / float16 to float32 (the destination takes 2 * nbytes). */
static PyObject *copy_regions(PyObject *self, PyObject *args) {
    PyObject *dsts_o, *src_o, *plan_o;
    int kind = COPY;
    if (!PyArg_ParseTuple(args, "OOO|i", &dsts_o, &src_o, &plan_o, &kind)) return NULL;
    if (kind < COPY || kind > F16_TO_F32) {
        PyErr_SetString(PyExc_ValueError, "copy_regions: unknown kind");
        return NULL;
    }
    const int64_t scale = kind == COPY ? 1 : 2;
    PyObject *seq = PySequence_Fast(dsts_o, "dsts must be a sequence of buffers");
    if (!seq) return NULL;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *d = PyMem_Calloc(nd ? nd : 1, sizeof(Py_buffer));
    Py_buffer src, plan;
    Py_ssize_t got = 0, total = 0;
    PyObject *res = NULL;
    if (!d) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (; got < nd; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &d[got], PyBUF_WRITABLE) < 0)
            goto out;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_SIMPLE) < 0) goto out;
    if (PyObject_GetBuffer(plan_o, &plan, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&src); goto out; }
    const int64_t *row = (const int64_t *)plan.buf;
    Py_ssize_t rows = plan.len / 32;
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t di = row[4 * i], doff = row[4 * i + 1], soff = row[4 * i + 2], n = row[4 * i + 3];
        if (di < 0 || di >= nd || doff < 0 || soff < 0 || n < 0 || n % scale ||
            doff + scale * n > d[di].len || soff + n > src.len) {
            PyErr_SetString(PyExc_ValueError, "copy_regions: region out of range");
            PyBuffer_Release(&plan); PyBuffer_Release(&src);
            goto out;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t di = row[4 * i], doff = row[4 * i + 1], soff = row[4 * i + 2], n = row[4 * i + 3];
        if (kind == COPY)
            memcpy((char *)d[di].buf + doff, (const char *)src.buf + soff, (size_t)n);
        else
            widen((char *)d[di].buf + doff, (const char *)src.buf + soff, n, kind);
        total += n;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&plan); PyBuffer_Release(&src);
    res = PyLong_FromSsize_t(total);
out:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&d[i]);
    PyMem_Free(d);
    Py_DECREF(seq);
    return res;
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

/* CUDA, loaded at run time (nothing links against it; IOD_CUDART names the
 * library to try first): records go from the arena, registered as pinned
 * host memory, straight into MLX's device arrays (DMA, ~50 GB/s measured on
 * the lent H200, against ~1 GB/s for mx.array + scatter through managed
 * memory). The copies of a plan are queued on one stream of our own and
 * waited for at its end; a stream that does not wait for MLX's (non-blocking) is
 * safe: the caller has synced at the layer's router, and no queued kernel
 * reads the positions a plan writes. Where the arena could not be pinned,
 * rows go through a pinned staging buffer of ours, so the DMA still runs
 * at pinned speed (a pageable cudaMemcpy is staged by the driver and
 * synchronous, ~2 GB/s). Each row is one DMA into MLX's managed memory:
 * on the H200 ~5 us a row idle and ~25 us behind queued kernels, however it
 * is issued (cudaMemcpyBatchAsync changed nothing), against ~50 GB/s for
 * one large row (an NVIDIA H200, 2026-12-01). */
typedef int (*memcpy_fn)(void *, const void *, size_t, int);
typedef int (*memcpy_async_fn)(void *, const void *, size_t, int, void *);
typedef int (*register_fn)(void *, size_t, unsigned int);
typedef int (*unregister_fn)(void *);
typedef int (*stream_create_fn)(void **, unsigned int);
typedef int (*stream_sync_fn)(void *);
typedef int (*host_alloc_fn)(void **, size_t, unsigned int);
typedef int (*last_error_fn)(void);
typedef int (*device_pointer_fn)(void **, void *, unsigned int);
static memcpy_fn cuda_memcpy;
static memcpy_async_fn cuda_memcpy_async;
static register_fn cuda_host_register;
static unregister_fn cuda_host_unregister;
static stream_create_fn cuda_stream_create;
static stream_sync_fn cuda_stream_sync;
static host_alloc_fn cuda_host_alloc;
static last_error_fn cuda_get_last_error;
static device_pointer_fn cuda_host_device_pointer;
static int cuda_state; /* 0 not tried, 1 loaded, -1 absent */
static void *copy_stream; /* created on first use, never destroyed */
static char *staging;     /* pinned, STAGING_BYTES, allocated on first use */
static int stream_tried, staging_tried; /* each set-up is tried once */
#define STAGING_BYTES ((size_t)32 << 20)
static pthread_mutex_t copy_lock = PTHREAD_MUTEX_INITIALIZER;

static int cuda_load(void) {
    if (cuda_state) return cuda_state > 0;
    const char *names[] = {getenv("IOD_CUDART"), "libcudart.so", "libcudart.so.13", "libcudart.so.12"};
    void *h = NULL;
    for (int i = 0; i < 4 && !h; i++)
        if (names[i] && names[i][0]) h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
    if (h) {
        cuda_memcpy = (memcpy_fn)dlsym(h, "cudaMemcpy");
        cuda_host_register = (register_fn)dlsym(h, "cudaHostRegister");
        cuda_host_unregister = (unregister_fn)dlsym(h, "cudaHostUnregister");
        /* the queued path; without any of these, one cudaMemcpy a row */
        cuda_memcpy_async = (memcpy_async_fn)dlsym(h, "cudaMemcpyAsync");
        cuda_stream_create = (stream_create_fn)dlsym(h, "cudaStreamCreateWithFlags");
        cuda_stream_sync = (stream_sync_fn)dlsym(h, "cudaStreamSynchronize");
        cuda_host_alloc = (host_alloc_fn)dlsym(h, "cudaHostAlloc");
        cuda_get_last_error = (last_error_fn)dlsym(h, "cudaGetLastError");
        cuda_host_device_pointer = (device_pointer_fn)dlsym(h, "cudaHostGetDevicePointer");
    }
    cuda_state = (cuda_memcpy && cuda_host_register && cuda_host_unregister) ? 1 : -1;
    return cuda_state > 0;
}

/* A refused set-up call leaves CUDA's last error set, which MLX would read
 * after its next kernel as its own failure: clear it. */
static void clear_cuda_error(void) {
    if (cuda_get_last_error) cuda_get_last_error();
}

/* cuda_available() -> bool */
static PyObject *cuda_available(PyObject *self, PyObject *args) {
    return PyBool_FromLong(cuda_load());
}

/* cuda_register(buffer, read_only) -> bool: pin a mapping for fast copies. */
static PyObject *cuda_register(PyObject *self, PyObject *args) {
    PyObject *obj; int ro; Py_buffer v;
    if (!PyArg_ParseTuple(args, "Op", &obj, &ro)) return NULL;
    if (!cuda_load()) Py_RETURN_FALSE;
    if (PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    /* mapped (2): kernels may read it too (infer.runtime.device) */
    rc = cuda_host_register(v.buf, (size_t)v.len, 2u | (ro ? 8u /* cudaHostRegisterReadOnly */ : 0u));
    if (rc) clear_cuda_error();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyBool_FromLong(rc == 0);
}

/* cuda_unregister(buffer) */
static PyObject *cuda_unregister(PyObject *self, PyObject *args) {
    PyObject *obj; Py_buffer v;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (!cuda_load()) Py_RETURN_NONE;
    if (PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE) < 0) return NULL;
    cuda_host_unregister(v.buf);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* cuda_device_pointer(buffer) -> the address a kernel reads a registered
 * buffer at (cudaHostGetDevicePointer), or 0 where there is none. */
static PyObject *cuda_device_pointer(PyObject *self, PyObject *args) {
    PyObject *obj; Py_buffer v; void *dev = NULL;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (!cuda_load() || !cuda_host_device_pointer) return PyLong_FromLong(0);
    if (PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE) < 0) return NULL;
    if (cuda_host_device_pointer(&dev, v.buf, 0u)) { clear_cuda_error(); dev = NULL; }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t((Py_ssize_t)(intptr_t)dev);
}

/* The rows of a plan, queued on ``stream`` and waited for at the end:
 * straight from src where it is pinned, else through the staging buffer
 * (waited for before it is reused; a row larger than it goes by
 * cudaMemcpy). Returns a CUDA error, or 0. */
static int copy_queued(void *stream, char *stage, const char *src, const int64_t *row,
                       Py_ssize_t rows, int pinned) {
    int rc = 0;
    size_t used = 0;
    for (Py_ssize_t i = 0; i < rows && rc == 0; i++) {
        void *dst = (void *)(intptr_t)row[3 * i];
        const char *from = src + row[3 * i + 1];
        size_t n = (size_t)row[3 * i + 2];
        if (pinned) {
            rc = cuda_memcpy_async(dst, from, n, 4 /* cudaMemcpyDefault */, stream);
        } else if (n > STAGING_BYTES) {
            rc = cuda_memcpy(dst, from, n, 4);
        } else {
            if (used + n > STAGING_BYTES) { /* reuse the buffer once its copies are done */
                rc = cuda_stream_sync(stream);
                used = 0;
            }
            if (rc == 0) {
                memcpy(stage + used, from, n);
                rc = cuda_memcpy_async(dst, stage + used, n, 4, stream);
                used += n;
            }
        }
    }
    int wait = cuda_stream_sync(stream);
    return rc ? rc : wait;
}

/* cuda_copy(src, plan, pinned) -> bytes copied. plan: int64 rows of
 * (destination address, source offset in src, nbytes); destinations are
 * device (or managed) addresses the caller took from its MLX arrays;
 * pinned: whether src is registered (cuda_register). */
static PyObject *cuda_copy(PyObject *self, PyObject *args) {
    PyObject *src_o, *plan_o; Py_buffer src, plan; int pinned = 0;
    if (!PyArg_ParseTuple(args, "OO|p", &src_o, &plan_o, &pinned)) return NULL;
    if (!cuda_load()) {
        PyErr_SetString(PyExc_RuntimeError, "cuda_copy: no CUDA runtime");
        return NULL;
    }
    if (PyObject_GetBuffer(src_o, &src, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(plan_o, &plan, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&src); return NULL; }
    const int64_t *row = (const int64_t *)plan.buf;
    Py_ssize_t rows = plan.len / 24, total = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t soff = row[3 * i + 1], n = row[3 * i + 2];
        if (row[3 * i] == 0 || soff < 0 || n < 0 || soff + n > src.len) {
            PyBuffer_Release(&plan); PyBuffer_Release(&src);
            PyErr_SetString(PyExc_ValueError, "cuda_copy: region out of range");
            return NULL;
        }
        total += n;
    }
    int rc = 0;
    /* set up once, with the GIL held; the copies take copy_lock (one stream,
     * one staging buffer) */
    if (cuda_memcpy_async && cuda_stream_create && cuda_stream_sync && !stream_tried) {
        void *s = NULL;
        stream_tried = 1;
        if (cuda_stream_create(&s, 1u /* cudaStreamNonBlocking */) == 0) copy_stream = s;
        else clear_cuda_error();
    }
    if (copy_stream && !pinned && cuda_host_alloc && !staging_tried) {
        void *p = NULL;
        staging_tried = 1;
        if (cuda_host_alloc(&p, STAGING_BYTES, 0u) == 0) staging = p;
        else clear_cuda_error();
    }
    void *stream = copy_stream; /* read with the GIL held */
    char *stage = staging;
    Py_BEGIN_ALLOW_THREADS
    if (stream && (pinned || stage)) {
        pthread_mutex_lock(&copy_lock);
        rc = copy_queued(stream, stage, (const char *)src.buf, row, rows, pinned);
        pthread_mutex_unlock(&copy_lock);
    } else {
        for (Py_ssize_t i = 0; i < rows && rc == 0; i++)
            rc = cuda_memcpy((void *)(intptr_t)row[3 * i], (const char *)src.buf + row[3 * i + 1],
                             (size_t)row[3 * i + 2], 4 /* cudaMemcpyDefault */);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&plan); PyBuffer_Release(&src);
    if (rc) return PyErr_Format(PyExc_RuntimeError, "cudaMemcpy failed (error %d)", rc);
    return PyLong_FromSsize_t(total);
}

/* address(buffer) -> the address of its first byte (for cuda_copy plans). */
static PyObject *address(PyObject *self, PyObject *args) {
    PyObject *obj; Py_buffer v;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE) < 0) return NULL;
    intptr_t a = (intptr_t)v.buf;
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t((Py_ssize_t)a);
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

/* shm_open_rw(name) -> fd: a session's read-write handle on the pin table. */
static PyObject *shm_open_rw(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int fd = shm_open(name, O_RDWR, 0);
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
    {"load_u64", load_u64, METH_VARARGS, "Load a u64 word (seq_cst)."},
    {"store_u64", store_u64, METH_VARARGS, "Store a u64 word (seq_cst)."},
    {"load_u32", load_u32, METH_VARARGS, "Load a u32 word (seq_cst)."},
    {"store_u32", store_u32, METH_VARARGS, "Store a u32 word (seq_cst)."},
    {"wait_u32", wait_u32, METH_VARARGS, "Wait, without the GIL, for a u32 word to hold a value."},
    {"add_u32", add_u32, METH_VARARGS, "Add to a u32 word (seq_cst); returns the new value."},
    {"pin_ready", pin_ready, METH_VARARGS, "Pin ready records found in the arena's directory."},
    {"unpin", unpin, METH_VARARGS, "Drop one pin per slot of a session's row."},
    {"pinned", pinned, METH_VARARGS, "A slot's pins summed over every row."},
    {"copy_regions", copy_regions, METH_VARARGS, "memcpy (or widen to float32) a plan of regions without the GIL."},
    {"cuda_available", cuda_available, METH_NOARGS, "Whether a CUDA runtime can be loaded."},
    {"cuda_register", cuda_register, METH_VARARGS, "Pin a host mapping for DMA (CUDA)."},
    {"cuda_unregister", cuda_unregister, METH_VARARGS, "Unpin a host mapping (CUDA)."},
    {"cuda_device_pointer", cuda_device_pointer, METH_VARARGS, "A registered buffer's device address (CUDA)."},
    {"cuda_copy", cuda_copy, METH_VARARGS, "Copy a plan of regions to the device without the GIL (queued on one stream)."},
    {"address", address, METH_VARARGS, "The address of a buffer's first byte."},
    {"pread_full", pread_full, METH_VARARGS, "pread into a buffer without the GIL."},
    {"shm_create", shm_create, METH_VARARGS, "Create a 0600 POSIX shm segment."},
    {"shm_open_readonly", shm_open_readonly, METH_VARARGS, "Open a shm segment read-only."},
    {"shm_open_rw", shm_open_rw, METH_VARARGS, "Open a shm segment read-write."},
    {"shm_unlink", shm_unlink_, METH_VARARGS, "Unlink a shm segment."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "native._iodnative", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__iodnative(void) { return PyModule_Create(&module); }
