"""The chunk pool: staged copies on node-local NVMe, the stager, and the peers over TCP.

Protocol (sans-I/O), the trio and the blocking clients, the peer server.
"""
