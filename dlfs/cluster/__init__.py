"""The cluster: which nodes a job has, which node owns which chunk, and the Slurm and MPI glue."""
