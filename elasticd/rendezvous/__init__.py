"""elasticd's torchrun rendezvous (``--rdzv-backend etcd-v3``), a package of its own.

Where things are: the entry point and its hooks (:mod:`.plugin`, re-exported at the stable
path ``elasticd.coordination.rendezvous``), torch's ``RendezvousHandler`` (:mod:`.handler`)
and its parts (:mod:`.join`, :mod:`.duty`, :mod:`.trust`), the closer's duty
(:mod:`.closer`), the agents' copy of the control keys (:mod:`.control`), the records
(:mod:`.records`), the pure decisions (:mod:`.rounds`, :mod:`.tally`), the rdzv-conf settings
(:mod:`.config`), outage retries (:mod:`.grace`), the port held for the workers' store
(:mod:`.port`) and the etcd-backed store torch's agent uses (:mod:`.store`).
It imports only :mod:`elasticd.coordination` (and torch, in the modules that run in the
agent); the daemon imports only the pure records and rules (:mod:`.records`, :mod:`.rounds`),
which import no torch.
"""
