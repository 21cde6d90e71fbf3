"""Pipeline parallelism: the stages of one PP group run the same engine in lockstep."""
