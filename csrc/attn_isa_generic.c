/* attn_isa_generic.c: the attention kernels (attn_body.h) in plain C, for any CPU (the
 * build's own flags; fmaf is a libm call where the CPU has no FMA). */
#define AT_LEVEL 1
#define AT_NAME attn_isa_generic
#define AT_LABEL "generic"
#include "attn_body.h"
