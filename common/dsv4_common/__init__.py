"""dsv4-serve's shared contract: model configs, the KV layout spec, the planner, the
DSV4Deployment spec and the documents exchanged by the operator, the router and the workers,
and the `dsv4` command line. Pure: never imports torch, kopf, the Kubernetes client or sockets.
"""
