"""Draft models the runtime ships and serves: the distilled draft's format, feature drafts,
and the measured choice of drafts per target; the shipped drafts' files sit beside them.
"""
