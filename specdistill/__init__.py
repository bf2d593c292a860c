"""Making a draft for a target by knowledge distillation (``specserve distill``).

``prompts`` builds diverse chat prompts offline, ``data`` has the target answer them and
records its next-token distributions, ``train`` distils a small draft from those, and
``draft`` is the draft directory format and its loader.
"""
