"""The contract between the operator, `dsv4 up`, the router and the workers: the
DSV4Deployment spec, the deployment's memory plan, and the versioned documents they exchange."""
