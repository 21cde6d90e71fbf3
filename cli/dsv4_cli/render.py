"""`dsv4 render`: every Kubernetes object the operator would apply for a DSV4Deployment file,
as a YAML stream. Imports the operator package only when run."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4_cli.usage import Usage, write
from dsv4_common.api.names import namespace_error


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render",
        help="print every object the operator would apply for a DSV4Deployment",
        description="Render a DSV4Deployment file to the Kubernetes objects the operator "
        "applies, as a YAML stream (for GitOps). Invalid specs and contexts that do not fit "
        "the memory plan are errors (exit 2).",
    )
    p.add_argument("file", help="YAML file holding one or more DSV4Deployment documents")
    p.add_argument("--namespace", "-n", default=None, help="namespace when the file has none")
    p.add_argument(
        "--model-config",
        default=None,
        metavar="FILE",
        help="the config.json that spec.model.configMapRef or spec.model.configPath names, or "
        "that an hf:// spec.model.source brings (render reads no cluster and no hub, and a "
        "configPath is a path on the operator's filesystem)",
    )
    p.add_argument(
        "--revision",
        default=None,
        metavar="COMMIT",
        help="the commit an hf:// spec.model.source resolves to (default: the one it names); "
        "the download's claim and Job are not rendered",
    )


def run(args: argparse.Namespace) -> int:
    try:
        from dsv4_operator.render import render_file
    except ImportError as exc:
        raise Usage(
            f"needs the operator package ({exc}): pip install 'dsv4-serve[operator]'"
        ) from exc
    import yaml

    from dsv4_common.api.deployment import MemoryPlanError
    from dsv4_common.api.spec import SpecError

    if args.namespace is not None and (why := namespace_error(args.namespace)):
        raise Usage(f"--namespace: {why}")
    try:
        model_config = Path(args.model_config).read_text() if args.model_config else None
    except (OSError, UnicodeDecodeError) as exc:
        raise Usage(f"--model-config {args.model_config}: {exc}") from exc
    try:
        text = render_file(
            Path(args.file),
            namespace=args.namespace,
            model_config=model_config,
            revision=args.revision,
        )
    except (SpecError, MemoryPlanError, yaml.YAMLError) as exc:
        raise Usage(str(exc)) from exc
    except OSError as exc:
        raise Usage(f"{args.file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise Usage(f"{args.file}: not UTF-8 text (byte {exc.start})") from exc
    write(text, newline=False)
    return 0
