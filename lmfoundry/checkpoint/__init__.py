"""Checkpoint I/O: everything that reads or writes model files on disk.

- `sources`: what a model argument names (a folder, a GGUF file, a built-in name) and the files
  it stands for;
- `headers`: safetensors headers and regular-file checks, read before any tensor is mapped
  (untrusted input: below everything else, the manifest uses them too);
- `folder`: the compressed-tensors checkpoint folder, its reader and its atomic writer, and
  the stored form of one quantized linear.

An engine bundle's files (its manifest and weight layout) are `lmfoundry.engine_bundle`'s.
"""
