"""The contract between the operator, `dsv4 up`, the router and the workers: the
DSV4Deployment spec, the deployment's memory plan, and the versioned documents they exchange."""

# Defined in `core` because the planner builds it too; this is its public name.
from dsv4_common.core.capacity import RankCapacity

__all__ = ["RankCapacity"]
