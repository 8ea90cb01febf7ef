"""Epoch order: who reads which sample when (docs/ORDER.md).

`dlfs.sampler.DLFSSampler` is the public entry. The pieces below it are pure
numpy, so every rank computes the same plan without talking to the others:

  seam.py        Locality + OrderClient: what the sampler needs from a mount's daemon
  plan.py        DistributedSampler's sizes, the random plan, the locality plan
  randomness.py  how random an epoch's order is (chunk mix per batch, epoch to epoch)
  ranks.py       rank/world from arguments, torch.distributed or the job's environment;
                 which node each rank runs on
"""
