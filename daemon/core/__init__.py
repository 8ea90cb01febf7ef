"""The read core: plain blocking code the FUSE adapters call and tests drive directly.

`namespace` maps inodes to (dataset, row) and answers lookup, getattr, readdir
and read; `reader` reads and verifies extents where `extentsource` says they
come from (staged copy, peer, store); `prefetch` pulls chunks into the page
cache; `lookahead` fetches an announced epoch ahead of its readers, which
`ordersock` (the order socket) feeds.
"""
