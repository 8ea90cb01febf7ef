"""The chunk pool: staged copies on node-local NVMe, the stager, and the peers over TCP.

The placement table and caches (pool, chunkcache), the stager and its demands,
replication and the scrub; the peer protocol (sans-I/O), the one blocking peer
client, the peer server and the node's shared peer fetches; `dlfs warmup`'s
engine (warmup: the stager in the foreground, no mount).
"""
