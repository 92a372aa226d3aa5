"""C kernels for the CPU runtime, built on the serving machine (`build`), each with a PyTorch
reference beside its binding: `paged_decode` (decode attention over the paged KV cache, read in
place), `store_kv` (the cache write), `bf16_gemv` (few-row bf16 products over a blocked weight).
A binding shares its name with the kernel family it serves in `lmfoundry.kernels`."""
