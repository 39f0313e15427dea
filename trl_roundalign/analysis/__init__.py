"""The measuring instruments behind `trl-roundalign analyze | probe` and the evidence scripts.

`scoring` (log-probs of the engine and of the Hugging Face model), `conditions` (region sets under a profile),
`compare` (each condition against the engine, token by token), `per_layer` (`analyze --per-layer`), `bitwise`,
`analyze` (the report), `engine_process` (an engine in a child process), `checkpoint`, and `probe/` (region and
model probes). Importing this package imports none of them.
"""
