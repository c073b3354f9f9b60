"""One scheduler step of the ``VERICACHE`` algorithm: the worker and what it reads and writes.

- ``worker``: the speculative worker SGLang's scheduler drives, one step at a time
- ``request_plan``: how each request is served (drafting, sampling, grammar, full-KV mode)
- ``forward``: the step's forward passes as SGLang batches
- ``draft_state``: the seeds carried between steps and the queries a prefill or verify pass leaves
- ``grammar_masks``, ``lookup_windows``: drafts under a grammar, prompt-lookup chains
- ``acceptance``, ``step_output``: the verdict per request and what the scheduler reads back
"""
