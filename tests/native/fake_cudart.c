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
 * errors set by a refusal and not yet read by cudaGetLastError */
static int64_t stats[7];
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
    int e = stats[6] ? 712 : 0;
    stats[6] = 0;
    return e;
}
int cudaHostUnregister(void *p) { return 0; }

void fake_stats(int64_t *out) { memcpy(out, stats, sizeof stats); }
