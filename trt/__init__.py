"""Draft engines: ONNX export, ONNX Runtime and TensorRT drafters."""
