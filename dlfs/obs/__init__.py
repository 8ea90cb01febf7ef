"""Reading what a daemon reports: `dlfs stats`, `dlfs status`, `dlfs trace`, `dlfs report`.

The writing side lives in the daemon (dlfsd.obs); these modules only read the
files, snapshots and socket replies it produces.
"""
