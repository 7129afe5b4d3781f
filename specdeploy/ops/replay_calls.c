/* One C loop over a CPU graph's recorded kernel calls (engine/cpu_graphs.py).

Why: a replayed step is ~30-50 calls into the kernel libraries, and each through ctypes costs
~2.5 us of argument conversion and libffi around a kernel of a few microseconds (a NemotronH MoE
decode step: ~7% of the step). Here each call is a function address with its arguments already
laid out, called in a loop.

How: every kernel takes integer-class arguments (pointers, int64, int32) and at most a few float
/ double ones. On x86-64 System V a call passes the integer-class arguments in order (6 in
registers, the rest in 8-byte stack slots) and the floating ones in order in xmm0-7, apart from
each other; so calling any such function through one type of 32 int64 and 8 double parameters
passes it its own arguments, the surplus ignored (its caller, this loop, pops them). A float
argument is read from the low 32 bits of its xmm register: its slot holds the float's bits
there. The Python side (engine/cpu_graphs.py `_batch`) takes only functions that fit (<= 32
integer-class, <= 8 floating arguments, no other types) and only on x86-64 Linux.
*/
#include <stdint.h>
#include <string.h>

typedef int64_t (*fn_t)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, double, double, double, double, double);

typedef struct { void *dst; const void *src; int64_t n; } restore_t;

typedef struct {
    void *fn;
    int64_t i[32];
    double d[8];
    int64_t expect;    /* the return value at capture */
    int32_t check;     /* 0: none (void), 1: int32, 2: int64 */
    int32_t nrestore;  /* registered structs' bytes restored before the call */
    restore_t restore[4];
} call_t;

/* 0, or 1 + the index of the first call that returned another value than at capture */
int64_t replay_calls(const call_t *c, int64_t n) {
    for (int64_t k = 0; k < n; k++, c++) {
        for (int32_t r = 0; r < c->nrestore; r++)
            memcpy(c->restore[r].dst, c->restore[r].src, (size_t)c->restore[r].n);
        int64_t v = ((fn_t)c->fn)(c->i[0], c->i[1], c->i[2], c->i[3], c->i[4], c->i[5], c->i[6], c->i[7], c->i[8], c->i[9], c->i[10], c->i[11], c->i[12], c->i[13], c->i[14], c->i[15], c->i[16], c->i[17], c->i[18], c->i[19], c->i[20], c->i[21], c->i[22], c->i[23], c->i[24], c->i[25], c->i[26], c->i[27], c->i[28], c->i[29], c->i[30], c->i[31],
                                  c->d[0], c->d[1], c->d[2], c->d[3], c->d[4], c->d[5], c->d[6], c->d[7]);
        if ((c->check == 1 && (int32_t)v != (int32_t)c->expect) ||
            (c->check == 2 && v != c->expect))
            return k + 1;
    }
    return 0;
}
