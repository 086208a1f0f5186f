/* The compiled loop of an incremental save: the positions of the 16-bit elements that differ
 * between two byte buffers of equal length (ckptkit.ops.incremental.changed_positions).
 *
 * Each block of 64 elements becomes one 64-bit mask of the elements that differ: SSE2 compares
 * where the processor has them; elsewhere (or built with -DCKPT_PORTABLE) 16 words compared at
 * once, an unchanged block skipped, and each word's 4 elements folded into 4 bits. A block with
 * at most 8 changes, the usual case of a sparse change, writes 8 positions whatever its count and
 * moves on by the count, so the loop does not branch on where the changed elements lie: that
 * branch, unpredictable on a random change, is what bounds numpy's flatnonzero. Built
 * optionally: without a compiler ckptkit uses numpy. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(CKPT_PORTABLE) && (defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2))
#include <emmintrin.h>
#define CKPT_SSE2 1
#endif

#if defined(_MSC_VER)
#include <intrin.h>
static int ctz64(uint64_t x) { unsigned long i; _BitScanForward64(&i, x); return (int)i; }
static int popcount64(uint64_t x) { return (int)__popcnt64(x); }
#else
static int ctz64(uint64_t x) { return __builtin_ctzll(x); }
static int popcount64(uint64_t x) { return __builtin_popcountll(x); }
#endif

#ifndef CKPT_SSE2
/* 8 bytes as a little-endian word whatever the processor's order (one load where it is little-endian). */
static inline uint64_t le64(const unsigned char *p)
{
    uint64_t x;
    memcpy(&x, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    return x;
}
#endif

/* Bit j set where element j of the 64 at a and b differ. */
static uint64_t differ64(const unsigned char *a, const unsigned char *b)
{
#ifdef CKPT_SSE2
    uint64_t same = 0;
    for (int q = 0; q < 4; q++) {
        const __m128i *pa = (const __m128i *)(a + 32 * q), *pb = (const __m128i *)(b + 32 * q);
        __m128i lo = _mm_cmpeq_epi16(_mm_loadu_si128(pa), _mm_loadu_si128(pb));
        __m128i hi = _mm_cmpeq_epi16(_mm_loadu_si128(pa + 1), _mm_loadu_si128(pb + 1));
        same |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_packs_epi16(lo, hi)) << (16 * q);
    }
    return ~same;
#else  /* other processors (and CKPT_PORTABLE builds): 16 words of 4 elements, each lane's bits folded */
    uint64_t d[16], any = 0;
    for (int w = 0; w < 16; w++) {
        d[w] = le64(a + 8 * w) ^ le64(b + 8 * w);
        any |= d[w];
    }
    if (!any)
        return 0;
    uint64_t m = 0;
    for (int w = 0; w < 16; w++) {
        uint64_t t = d[w];
        t |= t >> 8;  /* bit 16k: any bit of the word's element k (of 4) */
        t |= t >> 4;
        t |= t >> 2;
        t |= t >> 1;
        t &= 0x0001000100010001ULL;
        m |= ((t * 0x0001000200040008ULL) >> 48 & 0xF) << (4 * w);  /* the 4 bits side by side */
    }
    return m;
#endif
}

/* Store position `at` as element k of out (4 or 8 bytes wide). */
static inline void put(void *out, int wide, Py_ssize_t k, int64_t at)
{
    if (wide)
        ((int64_t *)out)[k] = at;
    else
        ((uint32_t *)out)[k] = (uint32_t)at;
}

/* The count of differing elements among n, their positions rising in out (room for limit + 8),
 * or -1 as soon as there are more than limit. */
static Py_ssize_t positions16(const unsigned char *a, const unsigned char *b, Py_ssize_t n, void *out, int wide, Py_ssize_t limit)
{
    Py_ssize_t k = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t m = differ64(a + 2 * i, b + 2 * i);
        if (!m)
            continue;
        int c = popcount64(m);
        if (k + c > limit)
            return -1;
        if (c <= 8) {  /* k + 8 <= limit + 8: the 8 stores fit; the ones past the count are overwritten later */
            for (int j = 0; j < 8; j++) {
                put(out, wide, k + j, (int64_t)i + ctz64(m | ((uint64_t)1 << 63)));
                m &= m - 1;
            }
        } else {
            for (Py_ssize_t j = k; m; j++) {
                put(out, wide, j, (int64_t)i + ctz64(m));
                m &= m - 1;
            }
        }
        k += c;
    }
    for (; i < n; i++) {
        if (memcmp(a + 2 * i, b + 2 * i, 2) != 0) {
            if (k >= limit)
                return -1;
            put(out, wide, k++, (int64_t)i);
        }
    }
    return k;
}

static PyObject *positions(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer before, after, out;
    Py_ssize_t limit, found = -2;
    if (!PyArg_ParseTuple(args, "y*y*w*n:positions", &before, &after, &out, &limit))
        return NULL;
    Py_ssize_t n = before.len / 2, width = out.itemsize;
    if (before.len != after.len)
        PyErr_SetString(PyExc_ValueError, "the two buffers differ in length");
    else if (limit < 0)
        PyErr_SetString(PyExc_ValueError, "the limit is negative");
    else if (width != 4 && width != 8)
        PyErr_SetString(PyExc_ValueError, "positions are written 4 or 8 bytes wide");
    else if (out.len / width < limit + 8)
        PyErr_SetString(PyExc_ValueError, "the output has no room for limit + 8 positions");
    else if (width == 4 && n > ((Py_ssize_t)1 << 32))
        PyErr_SetString(PyExc_ValueError, "positions past 2**32 need 8 bytes");
    else {
        Py_BEGIN_ALLOW_THREADS
        found = positions16((const unsigned char *)before.buf, (const unsigned char *)after.buf, n, out.buf, width == 8, limit);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&before);
    PyBuffer_Release(&after);
    PyBuffer_Release(&out);
    return found == -2 ? NULL : PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"positions", positions, METH_VARARGS,
     "positions(before, after, out, limit) -> count: write the positions of the 16-bit elements that differ "
     "between two byte buffers of equal length into out (4 or 8 bytes an item, room for limit + 8), rising; "
     "return their count, or -1 when there are more than limit."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_changed", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__changed(void) { return PyModule_Create(&module); }
