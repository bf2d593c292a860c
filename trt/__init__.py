"""Draft engines: ONNX export, ONNX Runtime and TensorRT drafters.

- ``backends``: ``load_draft(spec, target, backend, dtype)``, the start-up choice of engine;
- ``sources``: draft specs (model directories, ``default-truncated:N``) and weight hashes;
- ``step``: the single decoding step with explicit KV tensors, and the check against PyTorch;
- ``export``, ``manifest``, ``store``: ONNX export, its manifest, and the export cache;
- ``kv_drafter``: the Drafter protocol over any engine that runs the exported step;
- ``onnx_drafter``, ``tensorrt_build``, ``tensorrt_drafter``: the two engines;
- ``cli``: ``specserve export-draft``; ``bench_draft``: PyTorch vs ONNX Runtime benchmark.

``onnxruntime`` and ``tensorrt`` are imported only when used.
"""
