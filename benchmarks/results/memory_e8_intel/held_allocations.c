// LD_PRELOAD shim: which allocations of 64 KiB or more are still live when a layer is gone.
//
// Between held_start() and held_dump(path) every malloc/calloc/realloc/posix_memalign/aligned_alloc
// of at least 64 KiB is recorded with a short backtrace and forgotten again when freed; held_dump
// writes the ones still live ("== <bytes>" then one frame per line, "TOTAL <bytes>" last).
// Build: cc -O1 -shared -fPIC held_allocations.c -o held_allocations.so -ldl -lpthread
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define SLOTS (1 << 18)
#define DEPTH 12
#define MIN_BYTES 65536
#define TOMBSTONE ((void*)1)

typedef struct {
  void* ptr;
  size_t bytes;
  void* frames[DEPTH];
  int depth;
} Record;

static Record records[SLOTS];  // open addressing on the pointer
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int busy;  // backtrace() may allocate: never record from inside a record
static int recording;

static void* (*real_malloc)(size_t);
static void (*real_free)(void*);
static void* (*real_calloc)(size_t, size_t);
static void* (*real_realloc)(void*, size_t);
static int (*real_posix_memalign)(void**, size_t, size_t);
static void* (*real_aligned_alloc)(size_t, size_t);

static void resolve(void) {
  real_malloc = dlsym(RTLD_NEXT, "malloc");
  real_free = dlsym(RTLD_NEXT, "free");
  real_calloc = dlsym(RTLD_NEXT, "calloc");
  real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
  real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
}

static unsigned slot_of(void* p) { return (unsigned)(((uintptr_t)p >> 4) * 2654435761u) % SLOTS; }

static void remember(void* p, size_t bytes) {
  if (!recording || !p || bytes < MIN_BYTES || busy) return;
  busy = 1;
  pthread_mutex_lock(&lock);
  for (unsigned k = 0, i = slot_of(p); k < SLOTS; ++k, i = (i + 1) % SLOTS) {
    if (records[i].ptr == NULL || records[i].ptr == TOMBSTONE) {
      records[i].ptr = p;
      records[i].bytes = bytes;
      records[i].depth = backtrace(records[i].frames, DEPTH);
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  busy = 0;
}

static void forget(void* p) {
  if (!p) return;
  pthread_mutex_lock(&lock);
  for (unsigned k = 0, i = slot_of(p); k < SLOTS && records[i].ptr; ++k, i = (i + 1) % SLOTS) {
    if (records[i].ptr == p) {
      records[i].ptr = TOMBSTONE;
      break;
    }
  }
  pthread_mutex_unlock(&lock);
}

void* malloc(size_t n) {
  if (!real_malloc) resolve();
  void* p = real_malloc(n);
  remember(p, n);
  return p;
}

void* calloc(size_t count, size_t size) {
  if (!real_calloc) {  // dlsym itself calls calloc: serve it from a static buffer
    static char early[65536];
    static size_t used;
    void* p = early + used;
    used += (count * size + 15) & ~(size_t)15;
    return p;
  }
  void* p = real_calloc(count, size);
  remember(p, count * size);
  return p;
}

void* realloc(void* old, size_t n) {
  if (!real_realloc) resolve();
  forget(old);
  void* p = real_realloc(old, n);
  remember(p, n);
  return p;
}

int posix_memalign(void** out, size_t alignment, size_t n) {
  if (!real_posix_memalign) resolve();
  int err = real_posix_memalign(out, alignment, n);
  if (!err) remember(*out, n);
  return err;
}

void* aligned_alloc(size_t alignment, size_t n) {
  if (!real_aligned_alloc) resolve();
  void* p = real_aligned_alloc(alignment, n);
  remember(p, n);
  return p;
}

void free(void* p) {
  if (!real_free) resolve();
  if (recording) forget(p);
  real_free(p);
}

void held_start(void) { recording = 1; }

void held_dump(const char* path) {
  recording = 0;
  FILE* f = fopen(path, "w");
  if (!f) return;
  size_t total = 0;
  for (int i = 0; i < SLOTS; ++i) {
    if (records[i].ptr == NULL || records[i].ptr == TOMBSTONE) continue;
    total += records[i].bytes;
    fprintf(f, "== %zu\n", records[i].bytes);
    char** names = backtrace_symbols(records[i].frames, records[i].depth);
    for (int j = 1; j < records[i].depth; ++j) fprintf(f, "  %s\n", names ? names[j] : "?");
  }
  fprintf(f, "TOTAL %zu\n", total);
  fclose(f);
}
