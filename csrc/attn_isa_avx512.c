/* attn_isa_avx512.c: the attention kernels (attn_body.h) for AVX-512F, whatever the build
 * flags: attn.c runs them only on a CPU that has it. */
#if defined(__x86_64__)
#pragma GCC target("arch=skylake-avx512")
#define AT_LEVEL 3
#define AT_NAME attn_isa_avx512
#define AT_LABEL "avx512"
#include "attn_body.h"
#endif
