"""Coordination through etcd v3: the adapter interface, its implementations, the keyspace,
versioned records, leases, and (worker side) the torchrun rendezvous backend."""
