"""The benchmark: exactspec against plain decoding and Transformers, on the same models and prompts.

Modules, one job each: `config` (settings, prompts, configurations), `runners` (one measured
generation, a `results.RunResult`), `timing` (the cost model's timed inputs), `report` (rows, speedups, the measured cost
model, machine, JSON), `plot` (the cost-model figure), `run` (the whole benchmark), `batch`
(throughput at several batch sizes), `sampler` (the time of one `verify_block` call).
"""
