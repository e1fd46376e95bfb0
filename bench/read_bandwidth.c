/* A plain read of a 256 MiB buffer on T threads, best of 5 (bench/vs_llamacpp.py's memory floor: the rate
   a decode step that reads its bytes once could reach). Eight independent sums a thread keep the loads,
   not the adds, the limit; the compiler vectorises the loop (-O3 -march=native).
   usage: read_bandwidth THREADS  ->  prints GB/s */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BYTES (256L << 20)
static uint64_t *buffer;
static long threads;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *read_part(void *arg) {
    long words = BYTES / 8 / threads, id = (long)arg;
    const uint64_t *p = buffer + id * words;
    uint64_t s[8] = {0};
    for (long i = 0; i < words; i += 8)
        for (int j = 0; j < 8; j++) s[j] += p[i + j];
    uint64_t total = 0;
    for (int j = 0; j < 8; j++) total += s[j];
    return (void *)(uintptr_t)(total == 42);      /* keeps the sum live */
}

int main(int argc, char **argv) {
    threads = argc > 1 ? atol(argv[1]) : 1;
    if (threads < 1 || threads > 256) { fprintf(stderr, "error: read_bandwidth THREADS (1..256)\n"); return 2; }
    buffer = aligned_alloc(64, BYTES);
    if (!buffer) { fprintf(stderr, "error: cannot allocate %ld bytes\n", BYTES); return 1; }
    memset(buffer, 1, BYTES);
    double best = 1e30;
    pthread_t tid[256];
    for (int r = 0; r < 5; r++) {
        double t = now();
        for (long i = 0; i < threads; i++) pthread_create(&tid[i], NULL, read_part, (void *)i);
        for (long i = 0; i < threads; i++) pthread_join(tid[i], NULL);
        t = now() - t;
        if (t < best) best = t;
    }
    printf("%.2f\n", BYTES / best / 1e9);
    return 0;
}
