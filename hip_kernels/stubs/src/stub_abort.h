/* dflash LINK STUBS: the definitions behind a compile-only ggml-hip library (no ROCm installed).
 * Every function only reports that it was called and aborts: a library linked against these
 * stubs proves that the sources compile and that every symbol resolves, but it runs only with
 * ROCm's real libraries in its place (same sonames: libamdhip64.so.7, libhipblas.so.3).
 * Written without any HIP header on purpose: a C symbol carries no type, so each stub is a
 * no-argument function of the right name. */
#ifndef DFLASH_STUB_ABORT_H
#define DFLASH_STUB_ABORT_H
#include <stdio.h>
#include <stdlib.h>

__attribute__((noreturn, cold)) static void dflash_stub_abort(const char* lib, const char* name) {
    fprintf(stderr, "dflash: %s() called, but %s is a link stub (compile-only ggml-hip build without ROCm); "
                    "run with ROCm's real %s\n", name, lib, lib);
    fflush(stderr);
    abort();
}

#define DFLASH_STUB(lib, name) \
    __attribute__((visibility("default"))) int name(void); \
    int name(void) { dflash_stub_abort(lib, #name); }
#endif
