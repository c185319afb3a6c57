/* xxh.h: xxHash for the frame checksums, through xxHash's run-time dispatch where the installed
 * xxHash has it (x86-64 builds made with DISPATCH=1 install xxh_x86dispatch.h; Debian's and
 * Ubuntu's do): XXH3_64bits and XXH3_64bits_update then use AVX2 (or AVX-512) when the CPU has
 * it, instead of the SSE2 code of the library's plain entry points. The values are the same;
 * on data in the cache the rate about doubles (8.5 -> 20 GB/s for 256 KiB pieces on the 2-core
 * EPYC VM), which is most of what a frame reader does besides read(2). */
#ifndef DFL_XXH_H
#define DFL_XXH_H

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h> /* redefines XXH3_64bits, XXH3_64bits_update, XXH3_128bits, ... */
#define DFL_XXH_DISPATCH 1
#endif
#endif

#endif
