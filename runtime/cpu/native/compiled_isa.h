/* Which vector path this object was compiled for: 3 AMX (with AVX-512), 2 AVX-512, 1 AVX2 + FMA,
 * 0 none of them. build.py compiles it into every kernel (-include) and, where a path is forced
 * (LMFOUNDRY_CPU_ISA), checks that the path reached the compiler: the kernels' `#if`s read the
 * same macros. */
#ifndef LMF_COMPILED_ISA_H
#define LMF_COMPILED_ISA_H

int lmf_compiled_isa(void) {
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#endif
