"""Trying DLFS out: generated datasets and a training-epoch reader.

Not the core library: `dlfs demo`, the tests and the benchmarks use them;
nothing that populates, mounts or serves does.

  sampledata.py  ImageNet- and BERT-like trees of generated samples
  workload.py    one shuffled epoch read by N worker processes
"""
