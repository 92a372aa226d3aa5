"""The execution dtypes the CLI offers (no torch import: click reads them at import time)."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
