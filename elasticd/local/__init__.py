"""The local protocol between a node's daemon and its workers: framing and the request error
(:mod:`.wire`), an in-process job's link from its agent to its workers (:mod:`.worker_link`),
and which processes are a job's (:mod:`.job_scope`). Both sides import it; it imports nothing
of elasticd but the exception families (:mod:`elasticd.errors`), and no torch."""
