"""The quantized-weight format every stage speaks: which scheme a linear is stored in
(`scheme`), the reference quantize/dequantize arithmetic (`qmath`) and one linear's codes with
their qparams (`quantized_weight`).

It sits below both the model and the quantizers: the model's linears are built from it and the
quantizers produce it, so neither has to import the other to agree on what a quantized weight is.
The checkpoint, the runtime and compile read it too. It imports nothing of the model or any stage.
"""
