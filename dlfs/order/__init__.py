"""Epoch order: who reads which sample when (docs/ORDER.md).

`DLFSSampler` (sampler.py) is the public entry, imported as `dlfs.sampler`. The
pieces below it are pure numpy, so every rank computes the same plan without
talking to the others:

  sampler.py     DLFSSampler: the torch Sampler protocol over the plans; announces epochs
  plan.py        DistributedSampler's sizes, the random plan, the locality plan
  randomness.py  how random an epoch's order is (chunk mix per batch, epoch to epoch)
  ranks.py       rank/world from arguments, torch.distributed or the job's environment;
                 which node each rank runs on
  resume.py      a stopped epoch's state and what is left of it
  seam.py        Locality + OrderClient: what the sampler needs from a mount's daemon
  client.py      the sampler's side of the order socket (also `dlfs.orderclient`)
  wire.py        the order socket's wire format, which the daemon's side imports too
"""
