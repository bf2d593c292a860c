"""The drafters that plug into the speculative core (``decoding.drafter.Drafter``):
n-gram lookup, continuations from the prefix cache, a draft model, a feature head
over the target's states, and a mix of lookup and a model. Draft engines exported
to ONNX Runtime and TensorRT are ``trt``'s."""
