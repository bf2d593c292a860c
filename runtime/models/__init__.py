"""Model families and their modules: what a family's config says, the batched families'
modules (the skeleton), and reading checkpoints.
"""
