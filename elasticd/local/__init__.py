"""The local protocol between a node's daemon and its workers: framing and the request error
(:mod:`.wire`), a transport that calls the handlers in process (:mod:`.transport`), and which
processes are a job's (:mod:`.job_scope`). Both sides import it; it imports nothing else of
elasticd and no torch."""
