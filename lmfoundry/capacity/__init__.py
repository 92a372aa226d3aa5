"""`lmfoundry plan`: capacity planning before any GPU is rented — the inputs (`inputs.py`), the
arithmetic of parameters, weight and KV bytes, memory fit and cost (`arithmetic.py`), and the
report (`report.py`). Nothing here imports torch."""
