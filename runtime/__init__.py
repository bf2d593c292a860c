"""The model runtime: everything that turns a checkpoint into logits behind
``decoding.target.Target`` (file formats, quantized and dense matrices, model families,
the layer stack, the native kernels and their build)."""
