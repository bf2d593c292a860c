"""File formats and where models live: GGUF files, model configs, the catalogue and the
model store.
"""
