"""The model runtime: everything that turns a checkpoint into logits behind
``decoding.target.Target``, as a stack of layers, each importing only those below it
(``tests/test_layout.py`` checks):

    loaders, drafts   a runner from a name, a directory or a GGUF file; the shipped drafts
    runner            what a pass takes (``runner.passes``), the runners and their parts
    matrices          dense and quantized weights and their products
    models            model families, their modules, reading checkpoints
    native            the native kernels' sources and build
    files             file formats, configs, the model store
"""
