"""The model every stage executes: its configuration and the table of linears that share an
input (`config`), the reference decoder as plain `nn.Module`s (`reference`), the runtime linear
modules a stored scheme swaps in (`linears`, `quantized_linear`) and the KV-cache storage
arithmetic (`kv_quant`).

Calibration and the quantizers run it one layer at a time, compile reads its shapes, the runtime
serves it and the evals score it; it imports no stage (only the kernels' reference ops and the
quantized-weight format of `lmfoundry.quantformat`, which the quantizers produce).
"""
