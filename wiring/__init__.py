"""The wiring: concrete runtime models and the drafters built from the names a
user gives (a draft spec on the command line or in settings).

The speculative core (``decoding``) is handed a target and a drafter and never builds
one; this package builds them, importing both the core and the runtime. The command
line, the server's start-up, the exported-draft backends and the benchmarks use it.
"""
