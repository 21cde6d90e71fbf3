"""What engine sglang takes beyond the CRD's rules, checked when the objects are built (so the
reconcile reports InvalidSpec and the admission webhook refuses): `spec.<role>.engineArgs`
against SGLang's flags (the committed snapshot of the version the operator renders for,
`flags.py`), and layer splits SGLang can move KV between. Pure; every problem is a
`SpecError` naming the field (`spec.<role>.engineArgs[i]` and the flag), all collected at once.

Refused: a flag SGLang does not know (abbreviations included: argparse would take them, but
they hide which flag is meant), a flag the operator computes (`command.SERVER_FLAGS`,
under any of its aliases, and `--served-model-name` when `spec.model.servedModelNames` is set),
the few flags that would undo the plan (REFUSED), and a command line SGLang's parser rejects
once engineArgs are appended (a bad value, a missing one).
"""

from __future__ import annotations

import re
from typing import Final

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.errors import SpecError
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.flavors.sglang.command import (
    PP_RANK_ENV,
    SERVED_NAME_FLAG,
    SERVED_NAME_SOURCE,
    SERVER_FLAGS,
    expand,
    server_args,
)
from dsv4_operator.flavors.sglang.flags import (
    SGLANG_VERSION,
    SglangArgsError,
    parse_server_args,
    server_flag,
)

# Flags the operator does not compute but cannot let through, with why.
REFUSED: Final = {
    "--config": "a config file could set the flags the operator computes; give flags instead",
    "--speculative-algorithm": (
        "the memory plan prices no draft model (engine sglang runs without speculative decoding)"
    ),
}
# Refused when the role has more than one PP rank, with why.
REFUSED_WITH_PP: Final = {
    "--enable-dp-attention": (
        "with pipelineParallel > 1 SGLang derives DP attention's ports from --dist-init-addr's "
        "port + 1..6, which collide with the bootstrap port"
    ),
}
_NUMBER: Final = re.compile(r"^-\d|^-\.\d")


def _canonical(name: str) -> str | None:
    """The flag's identity (its argparse dest), whichever of its spellings `name` is."""
    info = server_flag(name)
    return None if info is None else str(info.dest)


def _owned(spec: DeploymentSpec) -> dict[str, tuple[str, str]]:
    """dest -> (flag, what follows its name in the error), for every flag the operator computes
    (for this spec) or refuses."""
    out: dict[str, tuple[str, str]] = {}
    computed = dict(SERVER_FLAGS)
    if spec.model.served_model_names:
        computed[SERVED_NAME_FLAG] = SERVED_NAME_SOURCE
    for flag, source in computed.items():
        dest = _canonical(flag)
        assert dest is not None, f"{flag} is not an SGLang {SGLANG_VERSION} flag"
        out[dest] = (flag, f"is computed by the operator (from {source})")
    for flag, why in REFUSED.items():
        dest = _canonical(flag)
        if dest is not None:
            out[dest] = (flag, f"is refused: {why}")
    return out


def engine_args_errors(
    spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan, role: L.WorkerRole
) -> list[str]:
    """Why the role's engineArgs cannot run (empty: they can)."""
    role_spec = spec.role(role)
    path = f"spec.{role}.engineArgs"
    owned = _owned(spec)
    with_pp = {_canonical(f): (f, why) for f, why in REFUSED_WITH_PP.items()}
    errors: list[str] = []
    for i, arg in enumerate(role_spec.engine_args):
        if not arg.startswith("-") or _NUMBER.match(arg):
            continue  # a value
        flag = arg.split("=", 1)[0]
        dest = _canonical(flag)
        if dest is None:
            errors.append(f"{path}[{i}]: {flag} is not an SGLang {SGLANG_VERSION} flag")
        elif dest in owned:
            known, why = owned[dest]
            name = flag if flag == known else f"{flag} (an alias of {known})"
            errors.append(f"{path}[{i}]: {name} {why}")
        elif dest in with_pp and role_spec.pipeline_parallel > 1:
            errors.append(f"{path}[{i}]: {flag} is refused: {with_pp[dest][1]}")
    if errors or not role_spec.engine_args:
        return errors
    # Every rank's full command line, as the kubelet expands it, through SGLang's parser.
    argv = server_args(spec, meta, memory, role, 0)
    for rank in range(role_spec.pipeline_parallel):
        try:
            parse_server_args(list(expand(argv, {PP_RANK_ENV: str(rank)})))
        except SglangArgsError as exc:
            return [f"{path}: SGLang {SGLANG_VERSION} rejects the command line: {exc}"]
    return []


def split_errors(memory: MemoryPlan) -> list[str]:
    """SGLang's decode stage takes its KV from the prefill stage of the same rank (when both
    roles have the same PP size > 1), so both must hold the same layers."""
    prefill, decode = (tuple(r.layers for r in memory.role(role).ranks) for role in L.WORKER_ROLES)
    if len(decode) == 1 or prefill == decode:
        return []

    def split(ranks: tuple[tuple[int, int], ...]) -> str:
        return ", ".join(str(end - start) for start, end in ranks)

    return [
        f"spec.decode.layerSplit: with engine sglang each decode PP stage takes the KV of the "
        f"prefill stage of its rank, so both roles need one split; the plan gives prefill "
        f"[{split(prefill)}] and decode [{split(decode)}]: set layerSplit to the same on both"
    ]


def check_sglang_spec(spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan) -> None:
    """Raises SpecError naming every problem of both roles' engineArgs and of the split."""
    errors = [e for role in L.WORKER_ROLES for e in engine_args_errors(spec, meta, memory, role)]
    errors += split_errors(memory)
    if errors:
        raise SpecError(errors)
