"""FUSE adapters: translate kernel requests to calls of the core and answers back; decide nothing.

Both connections are mounted and their INIT answered by `rawsession` (`session`
for the datasets'). Forked workers then serve every other request, speaking the
kernel protocol themselves through one `requestloop`: `wireworker` for the
datasets (Namespace calls), `ckptworker` for the checkpoint directory (CkptTree
calls). `fusewire` holds the wire layouts, `listing` and `splicer` pack bulk
replies, `errnomap` is the one exception -> errno table.
"""
