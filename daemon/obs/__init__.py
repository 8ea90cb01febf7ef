"""What the daemon reports: counters, trace rings, the status file, `.dlfs/`, the control socket.

The reading side (`dlfs stats|status|trace|report`) lives in dlfs.obs.
"""
