"""The engine-bundle format, the one place that knows it: what `lmfoundry compile` writes and the
runtime, evals and `inspect` read.

- `engine_manifest`: engine.json (its format name and version, its checks), what makes a folder
  a bundle, where a tensor-parallel bundle keeps each rank and the weights, and every file's
  sha256 verified before anything of the bundle runs;
- `weight_layout`: the fused and tiled form of the weights compile writes and the runtime reads
  back (so the two sides share the layout, not each other).

It sits below compile, the runtime and evals (tests/test_import_layers.py), so each reaches the
format here and none imports another for it.
"""
