import elasticd.replication.server as sv
_init = sv.ReplicaServer.__init__
def __init__(self, *a, **k):
    k["chunk_size"] = 7 << 20
    _init(self, *a, **k)
sv.ReplicaServer.__init__ = __init__
