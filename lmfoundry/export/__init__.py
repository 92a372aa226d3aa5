"""Exports of a checkpoint into other runtimes' formats (GGUF for llama.cpp)."""
