/* A stand-in for libcudart with host memory (tests/test_cuda_copy.py): the
 * functions native.cuda_copy loads, with cudaMemcpyAsync run only when its
 * stream is synchronized, as a real DMA may be, so a copy that reused its
 * source before waiting would deliver the wrong bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QUEUE 65536
static struct { void *dst; const void *src; size_t n; } queue[QUEUE];
static int queued;
/* cudaMemcpy, cudaMemcpyAsync, syncs, stream flags, from staging, registers,
 * errors set by a refusal and not yet read by cudaGetLastError, batch calls,
 * copies queued by batch calls, the last batch's attribute flags */
static int64_t stats[10];
static char *staging;
static size_t staging_len;

static void drain(void) {
    for (int i = 0; i < queued; i++) memcpy(queue[i].dst, queue[i].src, queue[i].n);
    queued = 0;
}

int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
    drain(); /* the legacy stream waits for the others */
    memcpy(dst, src, n);
    stats[0]++;
    return 0;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (queued == QUEUE || stream != (void *)&stats) return 1;
    queue[queued].dst = dst, queue[queued].src = src, queue[queued].n = n;
    queued++;
    stats[1]++;
    if (staging && (const char *)src >= staging && (const char *)src + n <= staging + staging_len) stats[4]++;
    return 0;
}

static int version(void) {
    const char *v = getenv("FAKE_CUDART_VERSION");
    return v ? atoi(v) : 13000;
}

int cudaRuntimeGetVersion(int *v) {
    *v = version();
    return 0;
}

int cudaGetDevice(int *d) {
    *d = 0;
    return 0;
}

/* cudaMemcpyAttributes */
struct attrs { int order, src_type, src_id, dst_type, dst_id; unsigned flags; };

/* CUDA 13's signature (a8 is the stream), or 12.8's (a8 the failure index,
 * a9 the stream), as FAKE_CUDART_VERSION says */
int cudaMemcpyBatchAsync(void **dst, void **src, size_t *n, size_t count, struct attrs *a,
                         size_t *idx, size_t num_attrs, void *a8, void *a9) {
    void *stream = version() >= 13000 ? a8 : a9;
    if (getenv("FAKE_BATCH_FAIL")) { stats[6] = 1; return 1; /* cudaErrorInvalidValue */ }
    if (stream != (void *)&stats || num_attrs != 1 || idx[0] != 0 || a->order != 1) return 1;
    if (queued + count > QUEUE) return 1;
    for (size_t i = 0; i < count; i++) {
        queue[queued].dst = dst[i], queue[queued].src = src[i], queue[queued].n = n[i];
        queued++;
        if (staging && (const char *)src[i] >= staging && (const char *)src[i] + n[i] <= staging + staging_len) stats[4]++;
    }
    stats[7]++;
    stats[8] += count;
    stats[9] = a->flags | (a->dst_type == 1 ? 0x100 : 0);
    return 0;
}

int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    *stream = (void *)&stats;
    stats[3] = flags;
    return 0;
}

int cudaStreamSynchronize(void *stream) {
    drain();
    stats[2]++;
    return 0;
}

int cudaHostAlloc(void **p, size_t n, unsigned int flags) {
    staging = malloc(n);
    staging_len = n;
    *p = staging;
    return staging ? 0 : 2;
}

int cudaHostRegister(void *p, size_t n, unsigned int flags) {
    stats[5]++;
    if (getenv("FAKE_REFUSE")) { stats[6] = 1; return 712; /* cudaErrorHostMemoryAlreadyRegistered */ }
    return 0;
}

int cudaGetLastError(void) {
    int e = stats[6] ? 712 : 0; /* the code matters not, only that it is read */
    stats[6] = 0;
    return e;
}
int cudaHostUnregister(void *p) { return 0; }

void fake_stats(int64_t *out) { memcpy(out, stats, sizeof stats); }
