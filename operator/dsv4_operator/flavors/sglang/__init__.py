"""Engine `sglang`: upstream SGLang's server and sglang-router, launched with flags the operator
computes from the memory plan (`command`), checked against the committed flag snapshots
(`flags`, `snapshot`, `engine_args`), observed through `/server_info` (`info`). Pure.
"""
