"""Benchmarks of the serving core: decoding methods, drafter acceptance, concurrent
streams, the HTTP server, draft engines and the prefix cache. Each prints a table and
writes JSON; nothing in the serving packages imports this one."""
