/* attn_isa_avx2.c: the attention kernels (attn_body.h) for AVX2 + FMA + F16C (Haswell),
 * whatever the build flags: attn.c runs them only on a CPU that has them. */
#if defined(__x86_64__)
#pragma GCC target("arch=haswell")
#define AT_LEVEL 2
#define AT_NAME attn_isa_avx2
#define AT_LABEL "avx2"
#include "attn_body.h"
#endif
