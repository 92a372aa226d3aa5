"""`lmfoundry compile`: cross-compile a checkpoint's kernels per GPU architecture, without a GPU.

checkpoint (schemes, shapes) -> kernel selection (specializations, fusions, per-arch tiles) -> worker processes
(Triton AOT, SASS checks) -> bundle (engine.json, kernels/<sm>/, weights/) -> loader (cubins through
the CUDA driver, Triton JIT on a mismatch, PyTorch reference on CPU).
"""
