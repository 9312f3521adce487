"""The local protocol between a node's daemon and its workers: framing and the request error
(:mod:`.wire`), and a transport that calls the handlers in process (:mod:`.transport`). Both
sides import it; it imports nothing else of elasticd and no torch."""
