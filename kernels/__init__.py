"""Triton kernels for every scheme lmfoundry produces, each with a PyTorch reference beside it.

One module per kernel family (`w4a16`, `w8a8`, `fp8`, `norm_quant`, `activation`, `rotary`,
`kv_cache`, `paged_attention`), collected in `registry` with what each supports. Every op takes
`launcher=`: Triton JIT (or the interpreter), the reference, or the shipped-cubin launcher of an
engine bundle (`lmfoundry.runtime.kernel_set.load_engine`). `spec` describes kernels as plain data so
that `compile` can cross-compile them and a different Triton (or none) can launch the result.
"""
